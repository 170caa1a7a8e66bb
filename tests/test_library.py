"""Local models: finding the GGUF files that LM Studio, ollama, the Hugging Face cache, llama.cpp's
cache and FLYLOCAL_MODEL_PATH hold (flylocal.models.library), reading their headers without llama.cpp
(flylocal.gguf_info), and pairing drafts with targets.

Each test lays out every tool's folders in a HOME of its own. The fast tests fill them with tiny
GGUF files written by the gguf package; the slow ones link the real registry models in.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import GEMMA, GEMMA_Q8_0, SMOL, SMOL_Q4_0, model_path
from flylocal import models
from flylocal import gguf_info
from flylocal.errors import FlylocalError, ModelError
from flylocal.front.cli import main
from flylocal.front.model_commands import human_bytes
from flylocal.models import library

FT = gguf.LlamaFileType
TOKENS_A = ["<unk>", "<s>", "</s>", "a", "b", "ab", "ba", "abc"]
TOKENS_B = ["<pad>", "<eos>", "<bos>", "x", "y", "xy", "yx", "xyz", "zz"]

# Each tool's name for the files of the four roles (SMOL, SMOL_Q4_0, GEMMA, GEMMA_Q8_0).
LMSTUDIO_SMOL = "lmstudio:lmstudio-community/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_1.gguf"
LMSTUDIO_GEMMA_Q8 = "lmstudio:google/gemma-3-270m-GGUF/gemma-3-270m-Q8_0.gguf"
OLLAMA_SMOL_Q4_0 = "ollama:smollm2:135m-q4_0"
OLLAMA_GEMMA = "ollama:someone/gemma3:latest"
HF_GEMMA = "hf:bartowski/gemma-3-270m-GGUF/gemma-3-270m-Q4_K_M.gguf"
LLAMA_SMOL_Q4_0 = "llama.cpp:HuggingFaceTB_SmolLM2-135M-Instruct-GGUF_smollm2-135m-instruct-q4_0.gguf"
OLLAMA_BROKEN = "ollama:broken:latest"
BROKEN, CUT = "local:broken.gguf", "local:cut.gguf"
HUB_REVISION = "0123456789abcdef0123456789abcdef01234567"


def write_gguf(path: Path, *, arch="llama", tokens=TOKENS_A, types=None, merges=("a b",), bos=1,
               file_type=FT.MOSTLY_Q4_0, template=True, rows=4, padding=0, tokenizer="gpt2") -> Path:
    """A tiny GGUF file with f32 tensors whose sizes are multiples of 32 bytes, so that the file
    ends where its last tensor does. `padding` bytes of description make it larger without
    changing its parameters."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(path.stem)
    w.add_context_length(256)
    w.add_file_type(file_type)
    if padding:
        w.add_description("." * padding)
    w.add_tokenizer_model(tokenizer)
    w.add_token_list(list(tokens))
    w.add_token_types(list(types or [3, 3, 3] + [1] * (len(tokens) - 3)))
    if merges:
        w.add_token_merges(list(merges))
    w.add_bos_token_id(bos)
    w.add_eos_token_id(2)
    if template:
        w.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    w.add_tensor("token_embd.weight", np.zeros((rows, 8), np.float32))
    w.add_tensor("output.weight", np.ones((rows, 16), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def synthetic_models(folder: Path) -> dict[str, Path]:
    """Stand-ins for the four registry models: two of one vocabulary (the larger is the target),
    two of another, smaller than the target."""
    folder.mkdir()
    return {
        SMOL: write_gguf(folder / "smol.gguf", file_type=FT.MOSTLY_Q4_1, rows=8, padding=4096),
        SMOL_Q4_0: write_gguf(folder / "smol-q4_0.gguf", file_type=FT.MOSTLY_Q4_0, rows=8),
        GEMMA: write_gguf(folder / "gemma.gguf", arch="gemma3", tokens=TOKENS_B, merges=(), bos=2,
                          tokenizer="llama", file_type=FT.MOSTLY_Q4_K_M, template=False),
        GEMMA_Q8_0: write_gguf(folder / "gemma-q8.gguf", arch="gemma3", tokens=TOKENS_B, merges=(), bos=2,
                               tokenizer="llama", file_type=FT.MOSTLY_Q8_0, template=False, padding=64),
    }


def link(src: Path, dst: Path) -> None:
    """A hard link where the file system allows one, else a symbolic link: never a copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        os.symlink(src, dst)


def lay_out(home: Path, files: dict[str, Path], monkeypatch) -> None:
    """Every tool's folders, holding links to `files`, plus a corrupt and a truncated file."""
    link(files[SMOL], home / ".lmstudio/models" / LMSTUDIO_SMOL.partition(":")[2])
    link(files[GEMMA_Q8_0], home / ".cache/lm-studio/models" / LMSTUDIO_GEMMA_Q8.partition(":")[2])

    ollama = home / "ollama"
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama))
    for manifest, role in (("registry.ollama.ai/library/smollm2/135m-q4_0", SMOL_Q4_0),
                           ("registry.ollama.ai/someone/gemma3/latest", GEMMA)):
        digest = hashlib.sha256(role.encode()).hexdigest()
        layers = [{"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64},
                  {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"}]
        (ollama / "manifests" / manifest).parent.mkdir(parents=True)
        (ollama / "manifests" / manifest).write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
        link(files[role], ollama / "blobs" / f"sha256-{digest}")
    (ollama / "manifests/registry.ollama.ai/library/broken").mkdir()
    (ollama / "manifests/registry.ollama.ai/library/broken/latest").write_text("{not json")

    hub = home / "hf-hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    repo = hub / "models--bartowski--gemma-3-270m-GGUF"
    blob = "f" * 64
    link(files[GEMMA], repo / "blobs" / blob)
    snapshot = repo / "snapshots" / HUB_REVISION
    snapshot.mkdir(parents=True)
    (snapshot / HF_GEMMA.rpartition("/")[2]).symlink_to(f"../../blobs/{blob}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HUB_REVISION)

    llama = home / "llama-cache"
    monkeypatch.setenv("LLAMA_CACHE", str(llama))
    link(files[SMOL_Q4_0], llama / LLAMA_SMOL_Q4_0.partition(":")[2])

    mine = home / "mine"
    mine.mkdir()
    monkeypatch.setenv("FLYLOCAL_MODEL_PATH", os.pathsep.join([str(mine), str(home / "no-such-folder")]))
    (mine / "broken.gguf").write_bytes(b"GGUF" + bytes([3, 0, 0, 0]) + b"\xff" * 64)
    with open(files[SMOL], "rb") as f:     # half the synthetic file, 4 MB of the real one
        (mine / "cut.gguf").write_bytes(f.read(min(files[SMOL].stat().st_size // 2, 4 << 20)))


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A HOME of its own, with every tool's variable cleared. FLYLOCAL_MODELS keeps naming the
    registry's cache (set before HOME moves), so registry names still mean the real files."""
    monkeypatch.setenv("FLYLOCAL_MODELS", str(models.cache_dir()))
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for var in ("OLLAMA_MODELS", "HF_HUB_CACHE", "HF_HOME", "LLAMA_CACHE", "FLYLOCAL_MODEL_PATH", "FLYLOCAL_METADATA"):
        monkeypatch.delenv(var, raising=False)
    return home


@pytest.fixture
def fake_home(home, tmp_path, monkeypatch):
    files = synthetic_models(tmp_path / "made")
    lay_out(home, files, monkeypatch)
    return files


@pytest.fixture
def real_home(home, monkeypatch):
    files = {name: model_path(name) for name in (SMOL, SMOL_Q4_0, GEMMA, GEMMA_Q8_0)}
    lay_out(home, files, monkeypatch)
    return files


def run(capsys, *args) -> tuple[int, str, str]:
    """`flylocal ARGS` in this process, through the console entry point."""
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def listed(out: str) -> dict[str, str]:
    """The local-model rows of `models list`: name -> the rest of its row."""
    rows = out.split("LOCAL MODEL", 1)[1].splitlines()[1:]
    return {row.split()[0]: row.split(None, 1)[1] for row in rows}


# ---- the header reader

def test_header_reader_agrees_with_the_gguf_package(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", file_type=FT.MOSTLY_Q4_K_M, rows=8)
    info = gguf_info.read_info(path)
    reader = gguf.GGUFReader(path)
    assert info.architecture == "llama" and info.name == "m"
    assert info.parameters == sum(int(t.n_elements) for t in reader.tensors) == 8 * 8 + 8 * 16
    assert info.vocab_size == len(reader.fields["tokenizer.ggml.tokens"].data) == len(TOKENS_A)
    assert info.file_type == "Q4_K_M" and info.context_length == 256 and info.tokenizer == "gpt2"
    assert info.chat_template and info.file_size == path.stat().st_size


def test_fingerprint_is_the_tokenizer_and_nothing_else(tmp_path):
    def fingerprint(**kw):
        return gguf_info.read_info(write_gguf(tmp_path / f"{len(list(tmp_path.iterdir()))}.gguf", **kw)).fingerprint

    base = fingerprint()
    # the weights, their quantization, the architecture and the template are not the tokenizer
    assert fingerprint(rows=12, file_type=FT.MOSTLY_Q8_0, arch="qwen2", template=False, padding=100) == base
    assert fingerprint(tokens=TOKENS_A[:-1] + ["abd"]) != base          # one token's text
    assert fingerprint(types=[3, 3, 3, 1, 1, 1, 1, 4]) != base          # one token's type
    assert fingerprint(merges=("a b", "b a")) != base                   # the merges
    assert fingerprint(bos=0) != base                                   # a special token id
    assert fingerprint(tokenizer="llama") != base                       # the tokenizer model


def test_every_truncation_is_an_error_naming_the_file(tmp_path):
    whole = write_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    for n in range(len(whole)):
        cut.write_bytes(whole[:n])
        with pytest.raises(ModelError) as e:
            gguf_info.read_info(cut)
        assert str(cut) in str(e.value)


def test_corrupt_bytes_give_an_error_or_an_answer_never_a_crash(tmp_path):
    whole = write_gguf(tmp_path / "whole.gguf").read_bytes()
    header_end = whole.index(b"output.weight") + 64
    rng = random.Random(0)
    bad = tmp_path / "bad.gguf"
    for _ in range(500):
        data = bytearray(whole)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(header_end)] = rng.randrange(256)
        bad.write_bytes(bytes(data))
        try:
            gguf_info.read_info(bad)
        except ModelError as e:
            assert str(bad) in str(e)


# ---- finding files, and their names

def test_every_tool_s_layout_is_found_under_its_names(fake_home):
    found = {m.name: m for m in library.discover()}
    assert set(found) == {LMSTUDIO_SMOL, LMSTUDIO_GEMMA_Q8, OLLAMA_BROKEN, OLLAMA_SMOL_Q4_0, OLLAMA_GEMMA, HF_GEMMA,
                          LLAMA_SMOL_Q4_0, BROKEN, CUT}
    assert os.path.samefile(found[OLLAMA_SMOL_Q4_0].path, fake_home[SMOL_Q4_0])
    assert found[OLLAMA_SMOL_Q4_0].path.name.startswith("sha256-")
    assert "snapshots" in found[HF_GEMMA].path.parts and found[HF_GEMMA].path.is_symlink()
    short = {
        "SmolLM2-135M-Instruct-Q4_1": LMSTUDIO_SMOL,           # the file stem,
        "smollm2-135m-instruct-q4_1.GGUF": LMSTUDIO_SMOL,      # the file name, in any case
        "smollm2:135m-q4_0": OLLAMA_SMOL_Q4_0,                 # the name without its source
        "ollama:someone/gemma3": OLLAMA_GEMMA,                 # no tag: latest
        "someone/gemma3": OLLAMA_GEMMA,
        "bartowski/gemma-3-270m-GGUF/gemma-3-270m-Q4_K_M.gguf": HF_GEMMA,
    }
    for spec, name in short.items():
        assert library.find(spec).name == name, spec
    assert library.find("nothing-like-it") is None


def test_resolve_takes_a_registry_name_then_a_path_then_a_local_name(fake_home, tmp_path, monkeypatch):
    monkeypatch.setattr(library, "fetch_from_hub", lambda *a: pytest.fail("the hub was asked"))
    found = {m.name: m.path for m in library.discover()}
    for name in (OLLAMA_SMOL_Q4_0, LMSTUDIO_SMOL, HF_GEMMA, LLAMA_SMOL_Q4_0):
        assert models.resolve(name) == found[name]
    assert models.resolve("gemma-3-270m-Q8_0") == found[LMSTUDIO_GEMMA_Q8]
    # an existing path is a path, even where a local model has that name
    (tmp_path / "gemma-3-270m-Q8_0").write_bytes(fake_home[SMOL].read_bytes())
    monkeypatch.chdir(tmp_path)
    assert models.resolve("gemma-3-270m-Q8_0") == Path("gemma-3-270m-Q8_0")
    with pytest.raises(FlylocalError, match="unknown model 'no-such-model'"):
        models.resolve("no-such-model")
    with pytest.raises(FlylocalError, match="ollama manifest .*broken/latest"):
        models.resolve("ollama:broken")
    with pytest.raises(FlylocalError, match="model file not found"):
        models.resolve("/nonexistent/SmolLM2-135M-Instruct-Q4_1.gguf")


def test_an_ambiguous_name_is_one_line_listing_the_candidates(fake_home, home, monkeypatch, capsys):
    for folder, role in (("a", SMOL), ("b", SMOL_Q4_0), ("c", SMOL)):
        link(fake_home[role], home / "more" / folder / "smol.gguf")
    monkeypatch.setenv("FLYLOCAL_MODEL_PATH", str(home / "more"))
    with pytest.raises(FlylocalError) as e:
        models.resolve("smol")
    message = str(e.value)
    assert "ambiguous" in message and "\n" not in message
    assert "local:a/smol.gguf" in message and "local:b/smol.gguf" in message
    assert "local:c/smol.gguf" not in message             # a and c are one file
    rc, out, err = run(capsys, "models", "path", "smol")
    assert rc == 1 and out == "" and err.count("\n") == 1 and "local:b/smol.gguf" in err
    assert models.resolve("local:b/smol.gguf") == home / "more" / "b" / "smol.gguf"


def test_an_hf_file_missing_without_huggingface_hub_says_how_to_install_it(home, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)      # import fails
    rc, out, err = run(capsys, "models", "path", "hf:someone/some-GGUF/model-Q4_0.gguf")
    assert rc == 1 and out == ""
    assert err.count("\n") == 1 and "pip install 'flylocal[hf]'" in err
    rc, out, err = run(capsys, "models", "path", "hf:not-a-file")
    assert rc == 1 and "hf:ORG/REPO/FILE.gguf" in err


# ---- listing, showing, pairing

def test_listing_reads_every_header_and_goes_on_past_unreadable_files(fake_home, home, capsys):
    rc, out, err = run(capsys, "models", "list")
    assert rc == 0, err
    rows = listed(out)
    assert list(rows) == [LMSTUDIO_SMOL, LMSTUDIO_GEMMA_Q8, OLLAMA_BROKEN, OLLAMA_SMOL_Q4_0, OLLAMA_GEMMA,
                          HF_GEMMA, LLAMA_SMOL_Q4_0, BROKEN, CUT]
    size = human_bytes(fake_home[SMOL].stat().st_size)
    assert rows[LMSTUDIO_SMOL].split() == ["llama", "192", "Q4_1", size, "256", "8", "yes"]
    assert rows[OLLAMA_GEMMA].split()[:3] == ["gemma3", "96", "Q4_K_M"]
    assert rows[OLLAMA_GEMMA].split()[-2:] == ["9", "no"]
    for name, file in ((BROKEN, "broken.gguf"), (CUT, "cut.gguf")):
        assert rows[name].startswith("unreadable: ") and str(home / "mine" / file) in rows[name]
    assert rows[OLLAMA_BROKEN].startswith("unreadable: ollama manifest ") and "broken/latest" in rows[OLLAMA_BROKEN]


def test_a_second_listing_parses_nothing_and_a_changed_file_is_read_again(fake_home, monkeypatch):
    paths = [m.path for m in library.discover()]
    first = library.describe(paths)
    cache = json.loads(library.metadata_path().read_text())
    assert len(cache["files"]) == len(paths)
    assert not [p for p in library.metadata_path().parent.iterdir() if p.name.endswith(".tmp")]

    read = []
    real_read = library.read_info
    monkeypatch.setattr(library, "read_info", lambda p: read.append(p) or real_read(p))
    again = library.describe(paths)
    assert read == []
    assert [str(x) for x in again] == [str(x) for x in first]        # errors come back as they were
    changed = paths[0]
    st = changed.stat()
    os.utime(changed, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    library.describe(paths)
    assert read == [changed]


def test_show_prints_the_header_facts(fake_home, capsys):
    rc, out, err = run(capsys, "models", "show", "smollm2:135m-q4_0")
    assert rc == 0, err
    rows = dict(line.split(":", 1) for line in out.splitlines())
    rows = {k: v.strip() for k, v in rows.items()}
    assert rows["architecture"] == "llama" and rows["file type"] == "Q4_0"
    assert rows["parameters"] == "192 (192)" and rows["chat template"] == "yes"
    assert rows["vocabulary"] == "8 tokens (gpt2 tokenizer)"
    assert rows["tokenizer"] == gguf_info.read_info(fake_home[SMOL]).fingerprint
    rc, out, err = run(capsys, "models", "show", BROKEN)
    assert rc == 1 and "broken.gguf" in err and err.count("\n") == 1


def pairs_sections(out: str) -> tuple[list[str], list[str]]:
    """The draft names under "same vocabulary" and under "through text"."""
    same, text = out.split("same vocabulary:")[1].split("through text")
    names = lambda block: [line.split()[0] for line in block.splitlines() if line.startswith("  ") and
                           line.strip() != "none"]   # noqa: E731
    return names(same), names(text.split("requantized:")[0])


def test_pairs_rank_same_vocabulary_drafts_before_drafts_through_text(fake_home, capsys):
    rc, out, err = run(capsys, "models", "pairs", LMSTUDIO_SMOL)
    assert rc == 0, err
    same, text = pairs_sections(out)
    assert same == [OLLAMA_SMOL_Q4_0]                 # the llama.cpp cache's link to it: one file, once
    assert text == [OLLAMA_GEMMA, LMSTUDIO_GEMMA_Q8]  # HF's gemma is the ollama one; smaller first
    assert "requantized: " + OLLAMA_SMOL_Q4_0 in out  # the Q4_0 of the target is already here


def test_a_q4_0_draft_is_suggested_with_the_command_that_derives_it(fake_home, home):
    target = library.Candidate(LMSTUDIO_SMOL, library.find(LMSTUDIO_SMOL).path, gguf_info.read_info(fake_home[SMOL]))
    hint = library.requantize_hint(target, [])
    dest = home / "mine" / "SmolLM2-135M-Instruct-Q4_1-Q4_0.gguf"
    assert "local:SmolLM2-135M-Instruct-Q4_1-Q4_0.gguf" in hint
    assert f'quantize("{target.path}", "{dest}", "Q4_0")' in hint and "from flylocal.llama.model import quantize" in hint
    ollama = library.Candidate(OLLAMA_GEMMA, library.find(OLLAMA_GEMMA).path, gguf_info.read_info(fake_home[GEMMA]))
    assert "someone-gemma3-latest-Q4_0.gguf" in library.requantize_hint(ollama, [])   # not the blob's digest


# ---- the real models

@pytest.mark.slow
def test_the_real_models_are_read_right_in_every_layout(real_home, home, capsys):
    rc, out, err = run(capsys, "models", "list")
    assert rc == 0, err
    rows = {name: row.split() for name, row in listed(out).items()}
    expected = {   # architecture, file type, context, vocabulary, chat template
        LMSTUDIO_SMOL: ("llama", "Q4_1", "8192", "49152", "yes"),
        OLLAMA_SMOL_Q4_0: ("llama", "Q4_0", "8192", "49152", "yes"),
        LLAMA_SMOL_Q4_0: ("llama", "Q4_0", "8192", "49152", "yes"),
        HF_GEMMA: ("gemma3", "Q4_K_M", "32768", "262144", "no"),
        OLLAMA_GEMMA: ("gemma3", "Q4_K_M", "32768", "262144", "no"),
        LMSTUDIO_GEMMA_Q8: ("gemma3", "Q8_0", "32768", "262144", "no"),
    }
    for name, (arch, ftype, ctx, vocab, template) in expected.items():
        row = rows[name]
        assert (row[0], row[2], row[4], row[5], row[6]) == (arch, ftype, ctx, vocab, template), (name, row)
    assert rows[LMSTUDIO_SMOL][1] == "134.5M" and rows[HF_GEMMA][1] == "268.1M"
    assert rows[CUT][0] == "unreadable:" and "tensor" in " ".join(rows[CUT])
    assert str(home / "mine" / "cut.gguf") in " ".join(rows[CUT])


@pytest.mark.slow
def test_the_real_tokenizers_pair_up_by_fingerprint(real_home):
    fp = {name: gguf_info.read_info(path).fingerprint for name, path in real_home.items()}
    assert fp[SMOL] == fp[SMOL_Q4_0]
    assert fp[GEMMA] == fp[GEMMA_Q8_0]
    assert fp[SMOL] != fp[GEMMA]


@pytest.mark.slow
def test_pairs_for_the_default_target_list_its_q4_0_and_not_gemma(real_home, capsys):
    rc, out, err = run(capsys, "models", "pairs", SMOL)
    assert rc == 0, err
    same, text = pairs_sections(out)
    assert same == [SMOL_Q4_0]          # the registry's file; the ollama and llama.cpp links are it
    assert not any("gemma" in name for name in same)
    assert text == []                   # every gemma file is larger than the target
    assert f"registry model {SMOL_Q4_0} is this target requantized to Q4_0" in out


@pytest.mark.slow
@pytest.mark.parametrize("name", [OLLAMA_SMOL_Q4_0, LMSTUDIO_SMOL, "SmolLM2-135M-Instruct-Q4_1"])
def test_generation_runs_on_a_model_another_tool_keeps(real_home, name):
    # A fixed --k: an adaptive draft length would first measure a cost curve for each new path.
    done = subprocess.run([sys.executable, "-m", "flylocal", "generate", "--target", name, "--drafter", "pld",
                           "--k", "4", "--max-tokens", "8", "Name three colours."],
                          capture_output=True, text=True, timeout=300, env=os.environ.copy())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and "tok/s" in done.stderr


def test_hostile_places_do_not_break_a_listing(tmp_path, monkeypatch):
    """A HF repo whose refs/main is not text, a FLYLOCAL_MODEL_PATH entry naming no user, an
    ollama manifest pointing outside the blob store, and a header claiming billions of tensors:
    each is skipped or listed as unreadable, in one line, and nothing raises."""
    from flylocal import gguf_info
    from flylocal.errors import ModelError
    from flylocal.models import library

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("FLYLOCAL_METADATA", str(tmp_path / "meta.json"))
    for var in ("HF_HUB_CACHE", "HF_HOME", "OLLAMA_MODELS", "LLAMA_CACHE"):
        monkeypatch.delenv(var, raising=False)
    repo = tmp_path / ".cache" / "huggingface" / "hub" / "models--org--repo"
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_bytes(b"\xff\xfe\x00")
    manifest = tmp_path / ".ollama" / "models" / "manifests" / "registry.ollama.ai" / "library" / "evil" / "latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text('{"layers": [{"mediaType": "application/vnd.ollama.image.model", '
                        '"digest": "../../etc:' + "0" * 64 + '"}]}')
    huge = tmp_path / "models" / "huge.gguf"
    huge.parent.mkdir()
    huge.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (1 << 40).to_bytes(8, "little") + (1).to_bytes(8, "little"))
    monkeypatch.setenv("FLYLOCAL_MODEL_PATH", os.pathsep.join(["~no-such-user-flylocal/m", str(huge.parent), ""]))
    found = {m.name: m for m in library.discover()}
    assert found["ollama:evil:latest"].problem and "names the blob" in found["ollama:evil:latest"].problem
    assert "local:huge.gguf" in found
    with pytest.raises(ModelError, match="claims"):
        gguf_info.read_info(huge)
    [result] = library.describe([huge])
    assert isinstance(result, ModelError) and str(huge) in str(result) and "\n" not in str(result)


def test_control_characters_in_names_cannot_forge_rows(home, tmp_path, monkeypatch, capsys):
    """A file named `new\\nline.gguf` (or with a terminal escape) is one escaped row of each
    listing, and an error line about it stays one line."""
    folder = tmp_path / "odd"
    folder.mkdir()
    write_gguf(folder / "new\nline.gguf")
    write_gguf(folder / "red\x1b[31m.gguf")
    monkeypatch.setenv("FLYLOCAL_MODEL_PATH", str(folder))
    rc, out, err = run(capsys, "models", "list")
    assert rc == 0, err
    rows = out.split("LOCAL MODEL", 1)[1].splitlines()[1:]
    assert [r.split()[0] for r in rows] == ["local:new\\nline.gguf", "local:red\\x1b[31m.gguf"]
    assert "\x1b" not in out
    rc, out, err = run(capsys, "models", "show", "local:new\nline.gguf")
    assert rc == 0 and "local:new\\nline.gguf" in out and "\nline.gguf" not in out
    rc, out, err = run(capsys, "models", "show", str(folder / "gone\nfile.gguf"))
    assert rc == 1 and err.count("\n") == 1 and "gone\\nfile.gguf" in err


def test_model_path_naming_a_file_uses_it_and_a_missing_one_is_one_warning(home, tmp_path, monkeypatch, capsys):
    file = write_gguf(tmp_path / "mine.gguf")
    missing = tmp_path / "not-here"
    monkeypatch.setattr(library, "_warned", set())
    monkeypatch.setenv("FLYLOCAL_MODEL_PATH", os.pathsep.join([str(file), str(missing)]))
    rc, out, err = run(capsys, "models", "list")
    assert rc == 0, err
    assert list(listed(out)) == ["local:mine.gguf"]
    assert err.splitlines() == [f"flylocal: FLYLOCAL_MODEL_PATH names {missing}, which does not exist"]
    assert models.resolve("local:mine.gguf") == file
    rc, out, err = run(capsys, "models", "path", "mine")
    assert rc == 0 and out.strip() == str(file) and not err     # warned once a process
