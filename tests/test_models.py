"""The registry, fetching (offline: a loopback server and derivation), and compatibility."""

from __future__ import annotations

import hashlib
import http.server
import os
import threading

import pytest

from conftest import GEMMA_Q8_0, SMOL, SMOL_Q4_0, model_path
from flylocal import models
from flylocal.errors import FlylocalError


def test_registry_has_the_project_models():
    reg = models.load_registry()
    assert {SMOL, SMOL_Q4_0, "gemma-3-270m", GEMMA_Q8_0} <= set(reg)
    assert reg[SMOL].kind == "pypi"
    assert reg["gemma-3-270m"].source.count("+pypi:") == 3      # four wheels, concatenated
    assert reg[SMOL_Q4_0].source == f"derive:{SMOL}:Q4_0"
    assert all(len(e.sha256) == 64 for e in reg.values())


def test_registry_errors_name_the_line(tmp_path, monkeypatch):
    bad = tmp_path / "models.txt"
    bad.write_text("# ok\nonly-two fields\n")
    monkeypatch.setenv("FLYLOCAL_REGISTRY", str(bad))
    with pytest.raises(FlylocalError, match=r"models.txt:2: expected NAME SOURCE SHA256"):
        models.load_registry()


def test_resolve_names_paths_and_unknowns(tmp_path):
    assert models.resolve(SMOL) == models.local_path(SMOL)
    assert models.resolve(str(tmp_path / "x.gguf")) == tmp_path / "x.gguf"
    with pytest.raises(FlylocalError, match="unknown model 'no-such-model'"):
        models.resolve("no-such-model")


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("FLYLOCAL_MODELS", str(cache))
    return cache


@pytest.fixture(scope="module")
def smol_file():
    return model_path(SMOL)


def test_derive_by_quantizer_matches_recorded_sha(smol_file, isolated_cache):
    os.symlink(smol_file, isolated_cache / f"{SMOL}.gguf")
    notes = []
    path = models.resolve(SMOL_Q4_0, log=notes.append)   # derived offline on first use
    assert path == isolated_cache / f"{SMOL_Q4_0}.gguf"
    assert models.sha256_file(path) == models.load_registry()[SMOL_Q4_0].sha256
    assert any("deriving" in n for n in notes)


def test_missing_model_says_how_to_fetch(isolated_cache):
    with pytest.raises(FlylocalError, match=f"run `flylocal models fetch {SMOL}`"):
        models.resolve(SMOL)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_url_source_downloads_and_checks_sha(tmp_path, isolated_cache, monkeypatch):
    served = tmp_path / "www"
    served.mkdir()
    payload = b"GGUF" + os.urandom(1000)
    (served / "tiny.gguf").write_bytes(payload)
    handler = lambda *a, **kw: _Quiet(*a, directory=str(served), **kw)   # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/tiny.gguf"
        good = hashlib.sha256(payload).hexdigest()
        reg = tmp_path / "models.txt"
        reg.write_text(f"tiny {url} {good}\nbroken {url} {'0' * 64}\n")
        monkeypatch.setenv("FLYLOCAL_REGISTRY", str(reg))
        assert models.fetch("tiny").read_bytes() == payload
        with pytest.raises(FlylocalError, match="checksum mismatch for broken"):
            models.fetch("broken")
        assert not (isolated_cache / "broken.gguf").exists()
        assert not list(isolated_cache.glob("*.part"))
    finally:
        server.shutdown()


def test_compatibility_rule(smol, smol_draft, gemma_q8):
    models.check_compatible(smol, smol_draft)
    with pytest.raises(FlylocalError) as e:
        models.check_compatible(smol, gemma_q8)
    assert smol.name in str(e.value) and gemma_q8.name in str(e.value)
