"""The registry, fetching (offline: a loopback server and derivation), and compatibility."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

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


@pytest.mark.slow
def test_resolve_takes_a_fetched_registry_name():
    assert models.resolve(SMOL) == models.local_path(SMOL)


def test_resolve_names_paths_and_unknowns(tmp_path):
    path = tmp_path / "x.gguf"
    with pytest.raises(FlylocalError, match="model file not found"):
        models.resolve(str(path))
    path.write_text("not a model")
    with pytest.raises(FlylocalError, match="not a GGUF file"):
        models.resolve(str(path))
    path.write_bytes(b"GGUF" + bytes(60))          # the file is llama.cpp's to judge from here
    assert models.resolve(str(path)) == path
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


@pytest.fixture(scope="module")
def gemma_file():
    return model_path("gemma-3-270m")


@pytest.mark.slow
def test_derive_by_quantizer_matches_recorded_sha(smol_file, isolated_cache):
    os.symlink(smol_file, isolated_cache / f"{SMOL}.gguf")
    notes = []
    path = models.resolve(SMOL_Q4_0, log=notes.append)   # derived offline on first use
    assert path == isolated_cache / f"{SMOL_Q4_0}.gguf"
    assert models.sha256_file(path) == models.load_registry()[SMOL_Q4_0].sha256
    assert any("deriving" in n for n in notes)


@pytest.mark.slow
def test_the_bandwidth_bound_stand_in_derives_as_f32(gemma_file, isolated_cache):
    """F32 is llama.cpp's ALL_F32 file type, not a MOSTLY_ one: the stand-in target derives from
    Gemma's Q4_K_M file to the registry's sha256, and its tensors are F32."""
    from flylocal.gguf_info import read_info
    from flylocal.settings import STANDIN_TARGET

    os.symlink(gemma_file, isolated_cache / "gemma-3-270m.gguf")
    path = models.resolve(STANDIN_TARGET)
    assert models.sha256_file(path) == models.load_registry()[STANDIN_TARGET].sha256
    assert read_info(path).file_type == "F32"


def test_missing_model_says_how_to_fetch(isolated_cache):
    with pytest.raises(FlylocalError, match=f"run `flylocal models fetch {SMOL}`"):
        models.resolve(SMOL)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def www(tmp_path):
    """A loopback HTTP server: (directory it serves, its base URL)."""
    served = tmp_path / "www"
    served.mkdir()
    handler = lambda *a, **kw: _Quiet(*a, directory=str(served), **kw)   # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield served, f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_url_source_downloads_and_checks_sha(tmp_path, isolated_cache, monkeypatch, www):
    served, base = www
    payload = b"GGUF" + os.urandom(1000)
    (served / "tiny.gguf").write_bytes(payload)
    url = f"{base}/tiny.gguf"
    good = hashlib.sha256(payload).hexdigest()
    reg = tmp_path / "models.txt"
    reg.write_text(f"tiny {url} {good}\nbroken {url} {'0' * 64}\n")
    monkeypatch.setenv("FLYLOCAL_REGISTRY", str(reg))
    assert models.fetch("tiny").read_bytes() == payload
    with pytest.raises(FlylocalError, match="checksum mismatch for broken"):
        models.fetch("broken")
    assert not (isolated_cache / "broken.gguf").exists()
    assert not list(isolated_cache.glob("*.part"))


def test_fetch_removes_a_killed_fetchs_temp_file_and_fetches_a_corrupt_file_again(
        tmp_path, isolated_cache, monkeypatch, www):
    served, base = www
    payload = b"GGUF" + os.urandom(100_000)
    (served / "tiny.gguf").write_bytes(payload)
    reg = tmp_path / "models.txt"
    reg.write_text(f"tiny {base}/tiny.gguf {hashlib.sha256(payload).hexdigest()}\n")
    monkeypatch.setenv("FLYLOCAL_REGISTRY", str(reg))
    stale = isolated_cache / ".tiny.k1ll3d0x.part"          # left by a fetch killed with SIGKILL
    stale.write_bytes(b"GGUF half")
    other = isolated_cache / ".tiny.bar.k1ll3d0x.part"      # a temp file of another model, tiny.bar
    other.write_bytes(b"GGUF")
    path = models.fetch("tiny")
    assert not stale.exists() and other.exists()
    assert models.status("tiny") == "verified"

    with open(path, "r+b") as f:                             # damage it in place
        f.seek(50_000)
        f.write(os.urandom(64))
    assert models.status("tiny") == "corrupt (sha256 differs)"
    notes = []
    assert models.fetch("tiny", log=notes.append) == path
    assert path.read_bytes() == payload
    assert any(str(path) in n and "fetching tiny again" in n for n in notes), notes
    assert models.status("tiny") == "verified"


# Verification records: a load trusts a matching record and hashes otherwise.

@pytest.fixture
def tiny(tmp_path, isolated_cache, monkeypatch):
    """Registry model `tiny`, present in the cache as a cache from before records would hold it."""
    payload = b"GGUF" + os.urandom(10_000)
    reg = tmp_path / "models.txt"
    reg.write_text(f"tiny http://127.0.0.1:9/tiny.gguf {hashlib.sha256(payload).hexdigest()}\n")
    monkeypatch.setenv("FLYLOCAL_REGISTRY", str(reg))
    path = isolated_cache / "tiny.gguf"
    path.write_bytes(payload)
    return path


def test_resolve_hashes_once_then_trusts_the_record(tiny, monkeypatch):
    hashed = []
    real = models.sha256_file
    monkeypatch.setattr(models.registry, "sha256_file", lambda p: hashed.append(p) or real(p))
    assert models.resolve("tiny") == tiny                  # no record yet: hashed once, recorded
    assert hashed == [tiny] and models.stamp_path(tiny).exists()

    def no_hashing(p):
        raise AssertionError(f"hashed {p}")

    monkeypatch.setattr(models.registry, "sha256_file", no_hashing)
    for _ in range(3):
        assert models.resolve("tiny") == tiny


def test_touched_file_is_hashed_again_and_accepted(tiny):
    models.resolve("tiny")
    st = tiny.stat()
    os.utime(tiny, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    notes = []
    assert models.resolve("tiny", log=notes.append) == tiny
    assert any("verified again" in n for n in notes), notes
    models.resolve("tiny", log=lambda s: pytest.fail(f"noted again: {s}"))


def test_changed_file_is_a_one_line_error_naming_it_and_the_fix(tiny):
    models.resolve("tiny")
    with open(tiny, "ab") as f:
        f.write(b"more")
    with pytest.raises(FlylocalError) as e:
        models.resolve("tiny")
    message = str(e.value)
    assert "\n" not in message
    assert f"model file {tiny} changed since it was verified (size differs)" in message
    assert message.endswith("run `flylocal models fetch tiny --force`")


def test_unrecorded_file_with_the_wrong_sha_is_an_error(tiny):
    tiny.write_bytes(b"GGUF" + bytes(10_000))
    with pytest.raises(FlylocalError, match=rf"model file {tiny} does not match its sha256 in models.txt: "
                                            r"run `flylocal models fetch tiny --force`"):
        models.resolve("tiny")
    assert models.status("tiny") == "corrupt (sha256 differs)"
    assert not models.stamp_path(tiny).exists()


# Real processes and the real derived draft (no network: the base model is linked in).

@pytest.fixture(scope="module")
def smol_q4_0_file():
    return model_path(SMOL_Q4_0)


@pytest.fixture
def smol_cache(smol_file, isolated_cache):
    """An empty cache but for a link to the real base model, so SMOL_Q4_0 derives offline."""
    os.symlink(smol_file, isolated_cache / f"{SMOL}.gguf")
    return isolated_cache


@pytest.mark.slow
def test_derived_file_unlike_the_registry_is_recorded_with_its_own_sha(smol_cache, tmp_path, monkeypatch):
    base = models.load_registry()[SMOL]
    reg = tmp_path / "models.txt"            # as if another llama.cpp had written the recorded file
    reg.write_text(f"{SMOL} {base.source} {base.sha256}\nsmol-q4 derive:{SMOL}:Q4_0 {'0' * 64}\n")
    monkeypatch.setenv("FLYLOCAL_REGISTRY", str(reg))
    notes = []
    path = models.resolve("smol-q4", log=notes.append)
    assert any("made by another llama.cpp version" in n for n in notes), notes
    assert json.loads(models.stamp_path(path).read_text())["sha256"] == models.sha256_file(path)
    assert models.status("smol-q4") == "verified (local sha256)"

    def no_hashing(p):
        raise AssertionError(f"hashed {p}")

    monkeypatch.setattr(models.registry, "sha256_file", no_hashing)
    assert models.resolve("smol-q4") == path


def _flylocal(cache, out, *args):
    """Start `python -m flylocal ARGS` on `cache`; its stdout and stderr go to out.stdout/.stderr."""
    env = dict(os.environ, FLYLOCAL_MODELS=str(cache))
    env.pop("FLYLOCAL_REGISTRY", None)
    with open(f"{out}.stdout", "w") as o, open(f"{out}.stderr", "w") as e:
        return subprocess.Popen([sys.executable, "-m", "flylocal", *args], env=env, stdout=o, stderr=e)


def _text(out, stream="stderr"):
    with open(f"{out}.{stream}") as f:
        return f.read()


def _wait_until(cond, timeout, what):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def _listed_state(cache, tmp_path, name):
    p = _flylocal(cache, tmp_path / "list", "models", "list")
    assert p.wait(timeout=300) == 0, _text(tmp_path / "list")
    line = next(l for l in _text(tmp_path / "list", "stdout").splitlines() if l.split()[0] == name)
    return line.split(None, 2)[2]


def _assert_fetched_cleanly(cache, tmp_path):
    dest = cache / f"{SMOL_Q4_0}.gguf"
    assert models.sha256_file(dest) == models.load_registry()[SMOL_Q4_0].sha256
    assert not [p.name for p in cache.iterdir() if p.name.endswith(".part")]
    assert _listed_state(cache, tmp_path, SMOL_Q4_0).startswith("verified ")


@pytest.mark.slow
def test_two_fetches_at_once_derive_once(smol_cache, tmp_path):
    a = _flylocal(smol_cache, tmp_path / "a", "models", "fetch", SMOL_Q4_0)
    b = _flylocal(smol_cache, tmp_path / "b", "models", "fetch", SMOL_Q4_0)
    assert a.wait(timeout=300) == 0, _text(tmp_path / "a")
    assert b.wait(timeout=300) == 0, _text(tmp_path / "b")
    errs = [_text(tmp_path / "a"), _text(tmp_path / "b")]
    assert sum("deriving" in e for e in errs) == 1, errs     # the second found the first's file
    _assert_fetched_cleanly(smol_cache, tmp_path)


@pytest.mark.slow
def test_fetch_interrupted_half_way_while_another_waits(smol_cache, tmp_path):
    a = _flylocal(smol_cache, tmp_path / "a", "models", "fetch", SMOL_Q4_0)
    try:
        def writing():
            try:
                return any(p.stat().st_size > 0 for p in smol_cache.glob("*.part"))
            except FileNotFoundError:
                return False

        _wait_until(lambda: a.poll() is not None or writing(), 300, "the quantizer to start writing")
        assert a.poll() is None, _text(tmp_path / "a")
        a.send_signal(signal.SIGSTOP)                        # half-way through writing, holding the lock
        b = _flylocal(smol_cache, tmp_path / "b", "models", "fetch", SMOL_Q4_0)
        _wait_until(lambda: b.poll() is not None or "waiting for another fetch" in _text(tmp_path / "b"),
                    120, "the second fetch to wait for the first")
        assert b.poll() is None and "waiting for another fetch" in _text(tmp_path / "b")   # the lock held it
        a.send_signal(signal.SIGINT)
    finally:
        a.send_signal(signal.SIGCONT)
    assert a.wait(timeout=300) == 130, _text(tmp_path / "a")
    assert "Traceback" not in _text(tmp_path / "a")
    assert b.wait(timeout=300) == 0, _text(tmp_path / "b")
    assert "deriving" in _text(tmp_path / "b")
    _assert_fetched_cleanly(smol_cache, tmp_path)


@pytest.mark.slow
def test_corrupt_cached_file_is_reported_and_fetched_again(smol_q4_0_file, smol_cache, tmp_path):
    dest = smol_cache / f"{SMOL_Q4_0}.gguf"
    shutil.copyfile(smol_q4_0_file, dest)                    # a copy: the real cache stays untouched
    notes = []
    assert models.fetch(SMOL_Q4_0, log=notes.append) == dest  # present and verified: kept, recorded
    assert not any("deriving" in n for n in notes) and models.stamp_path(dest).exists()
    models.resolve(SMOL_Q4_0)

    size = dest.stat().st_size
    with open(dest, "r+b") as f:                             # random bytes into the middle
        f.seek(size // 2)
        f.write(os.urandom(4096))
    assert dest.stat().st_size == size
    assert models.status(SMOL_Q4_0) == "corrupt (sha256 differs)"
    assert _listed_state(smol_cache, tmp_path, SMOL_Q4_0).startswith("corrupt (sha256 differs)")

    fix = f"run `flylocal models fetch {SMOL_Q4_0} --force`"
    with pytest.raises(FlylocalError) as e:
        models.resolve(SMOL_Q4_0)
    assert "\n" not in str(e.value)
    assert str(e.value) == f"model file {dest} changed since it was verified (sha256 differs): {fix}"

    gen = _flylocal(smol_cache, tmp_path / "gen", "generate", "hi", "--max-tokens", "2", "--target", SMOL_Q4_0)
    assert gen.wait(timeout=300) != 0
    err = _text(tmp_path / "gen")
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1 and err.startswith("flylocal: error: "), err
    assert str(dest) in err and fix in err
    assert _text(tmp_path / "gen", "stdout") == ""

    notes = []
    assert models.fetch(SMOL_Q4_0, log=notes.append) == dest  # corrupt: derived again, with a note
    assert any("fetching" in n and "again" in n for n in notes) and any("deriving" in n for n in notes)
    assert models.sha256_file(dest) == models.load_registry()[SMOL_Q4_0].sha256
    assert models.status(SMOL_Q4_0) == "verified"
    models.resolve(SMOL_Q4_0)


def test_compatibility_rule(smol, smol_draft, gemma_q8):
    models.check_compatible(smol, smol_draft)
    with pytest.raises(FlylocalError) as e:
        models.check_compatible(smol, gemma_q8)
    assert smol.name in str(e.value) and gemma_q8.name in str(e.value)
