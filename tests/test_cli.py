"""The `flylocal` command end to end, in subprocesses: output contracts and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import GEMMA_Q8_0, SMOL, model_path, prompt
from flylocal.decoding.costs import store

PROMPT = "Name three colours."


def flylocal(*args, stdin=None, env=None, text=True):
    return subprocess.run([sys.executable, "-m", "flylocal", *args], capture_output=True, text=text,
                          input=stdin, env={**os.environ, **(env or {})}, timeout=300)


def assert_one_line_error(done, *words):
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("flylocal: error: ")
    for w in words:
        assert w in lines[0], lines[0]


@pytest.mark.slow
def test_json_output_contract():
    done = flylocal("generate", PROMPT, "--max-tokens", "24", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert set(out) == {"text", "tokens", "prompt_tokens", "build", "threads", "thread_use", "stats"}
    assert 1 <= out["threads"] <= len(os.sched_getaffinity(0))
    use = out["thread_use"]           # --threads auto: what it used and why (docs/operations.md, "Threads")
    assert use["count"] == out["threads"] and use["moves"] and all(m["why"] for m in use["moves"])
    assert sum(use["decodes"].values()) > 0 and all(1 <= int(c) <= len(os.sched_getaffinity(0)) for c in use["decodes"])
    assert out["text"] and len(out["tokens"]) <= 24 and out["prompt_tokens"] > 5
    for key in ("rounds", "drafted", "accepted", "loose", "emitted", "mean_accepted_length",
                "prefill_s", "wall_s", "target_s", "draft_s", "verify_s", "tokens_per_s"):
        assert key in out["stats"]


@pytest.mark.slow
def test_streamed_text_equals_json_text_and_stats_go_to_stderr():
    streamed = flylocal("generate", PROMPT, "--max-tokens", "24", "--drafter", "none")
    as_json = json.loads(flylocal("generate", PROMPT, "--max-tokens", "24", "--drafter", "none", "--json").stdout)
    assert streamed.returncode == 0
    assert streamed.stdout == as_json["text"] + "\n"
    assert "tok/s" in streamed.stderr and "mean accepted length" in streamed.stderr


@pytest.mark.slow
def test_prompt_file_and_stdin(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text(PROMPT)
    a = json.loads(flylocal("generate", "--prompt-file", str(f), "--max-tokens", "8", "--json").stdout)
    b = json.loads(flylocal("generate", "--prompt-file", "-", "--max-tokens", "8", "--json", stdin=PROMPT).stdout)
    assert a["tokens"] == b["tokens"]


@pytest.mark.slow
def test_trace_rows_follow_the_strict_rule(tmp_path):
    trace = tmp_path / "t.jsonl"
    done = flylocal("generate", "Repeat exactly: the cat sat on the mat, the cat sat on the mat.",
                    "--verifier", "strict", "--k", "6", "--max-tokens", "40", "--trace", str(trace), "--json")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    out = json.loads(done.stdout)
    assert len(rows) == out["stats"]["rounds"]
    assert any(r["accepted"] > 0 for r in rows)
    for i, r in enumerate(rows):
        d, a, k, L = r["draft"], r["target_argmax"], len(r["draft"]), r["accepted"]
        assert r["round"] == i and len(a) == k + 1 and len(r["entropy"]) == k and len(r["regret"]) == k
        native = next((j for j in range(k) if d[j] != a[j]), k)
        assert L == native and r["loose"] == []
        assert r["emitted"] == d[:L] + [a[L]]
        # regret: 0 exactly at native matches, the target's positive logit gap at every mismatch
        assert all((reg == 0) == (d[j] == a[j]) for j, reg in enumerate(r["regret"]))
    assert [t for r in rows for t in r["emitted"]][: len(out["tokens"])] == out["tokens"]


@pytest.mark.slow
def test_raw_gemma_says_there_is_no_template():
    done = flylocal("generate", "The sky is", "--target", GEMMA_Q8_0, "--max-tokens", "4")
    assert done.returncode == 0
    assert "no chat template" in done.stderr


@pytest.mark.parametrize("args,words", [
    (["--target", "/nonexistent/model.gguf"], ["model file not found"]),
    (["--target", "no-such-model"], ["unknown model"]),
    (["--k", "-1"], ["--k"]),
    (["--max-tokens", "0"], ["--max-tokens"]),
    (["--drafter", "model"], ["needs a draft model"]),
    pytest.param(["--draft", GEMMA_Q8_0, "--drafter", "model", "--draft-vocab", "same"],
                 ["incompatible", "gemma-3-270m-q8_0", "smollm2-135m-instruct"], marks=pytest.mark.slow),
    (["--draft-vocab", "other"], ["--draft-vocab"]),
    pytest.param(["--ctx", "32"], ["longer than the context", "--ctx 32"], marks=pytest.mark.slow),
    (["--temperature", "-0.5"], ["--temperature"]),
    (["--top-p", "0"], ["--top-p"]),
    (["--min-p", "1.5"], ["--min-p"]),
    (["--repeat-penalty", "0"], ["--repeat-penalty"]),
    (["--seed", "-1"], ["--seed"]),
    (["--temperature", "nan"], ["--temperature", "not a finite number"]),
    (["--temperature", "inf"], ["--temperature", "not a finite number"]),
    (["--repeat-penalty", "nan"], ["--repeat-penalty", "not a finite number"]),
    (["--asd-budget", "nan"], ["--asd-budget", "not a finite number"]),
    (["--fly-entropy", "nan"], ["--fly-entropy", "not a finite number"]),
    (["--threads", "1000"], ["--threads", "1000", "cores"]),
    (["--threads", "many"], ["--threads", "neither auto nor a number"]),
    (["--threads", "-2"], ["--threads", "not a number of threads"]),
])
def test_bad_input_gets_one_line(args, words):
    assert_one_line_error(flylocal("generate", PROMPT * 5, *args), *words)


@pytest.mark.slow
def test_bad_model_files(tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    assert_one_line_error(flylocal("generate", PROMPT, "--target", str(text)), "not a GGUF file")
    truncated = tmp_path / "truncated.gguf"
    with open(model_path(SMOL), "rb") as f:
        truncated.write_bytes(f.read(4 << 20))
    assert_one_line_error(flylocal("generate", PROMPT, "--target", str(truncated)), "cannot load", "truncated.gguf",
                          "not within the file bounds")     # llama.cpp's own reason


def test_unwritable_trace_file():
    assert_one_line_error(flylocal("generate", PROMPT, "--max-tokens", "2", "--trace", "/nonexistent/dir/t.jsonl"),
                          "cannot write the trace file")


def test_no_prompt():
    assert_one_line_error(flylocal("generate"), "no prompt")


def test_models_commands_without_models(tmp_path):
    """The fast suite needs no model: with an empty cache, the registry is listed as not fetched,
    and asking for a model's path says how to fetch it."""
    empty = {"FLYLOCAL_MODELS": str(tmp_path / "none"), "HOME": str(tmp_path), "FLYLOCAL_MODEL_PATH": ""}
    listed = flylocal("models", "list", env=empty)
    assert listed.returncode == 0, listed.stderr
    assert SMOL in listed.stdout and "verified" not in listed.stdout
    assert_one_line_error(flylocal("models", "path", SMOL, env=empty), f"flylocal models fetch {SMOL}")
    assert_one_line_error(flylocal("models", "path", "nope", env=empty), "unknown model")


@pytest.mark.slow
def test_models_commands_on_the_fetched_models():
    listed = flylocal("models", "list")
    assert listed.returncode == 0 and SMOL in listed.stdout and "verified" in listed.stdout
    path = flylocal("models", "path", SMOL)
    assert path.stdout.strip() == str(model_path(SMOL))


@pytest.mark.slow
def test_doctor_reports_build_and_invariance():
    done = flylocal("doctor", "--model", SMOL)
    assert done.returncode == 0, done.stderr
    assert "llama-cpp-python" in done.stdout and "system:" in done.stdout
    assert "batch-invariant: yes" in done.stdout


@pytest.mark.slow
def test_infinite_entropy_gate_is_strict():
    """inf is a meaningful value for --fly-entropy (and ASD's gate and budget): FLy becomes strict."""
    args = ["generate", prompt("poem-autumn"), "--max-tokens", "48", "--json",
            "--draft", "smollm2-135m-instruct-q4_0", "--drafter", "model", "--k", "10"]
    strict = json.loads(flylocal(*args, "--verifier", "strict").stdout)
    fly = json.loads(flylocal(*args, "--fly-entropy", "inf").stdout)
    assert fly["tokens"] == strict["tokens"] and fly["stats"]["loose"] == 0 and fly["stats"]["drafted"] > 0
    # (that an open gate keeps loose tokens is built, not hoped for: test_fly_models.py, FourthBest)


def test_invalid_utf8_gets_one_line(tmp_path):
    bad = b"caf\xe9 au lait"
    f = tmp_path / "latin1.txt"
    f.write_bytes(bad)
    assert_one_line_error(flylocal("generate", "--prompt-file", str(f)), "latin1.txt", "not valid UTF-8")
    done = flylocal("generate", "--prompt-file", "-", stdin=bad, text=False)
    done.stderr = done.stderr.decode()
    assert_one_line_error(done, "stdin", "not valid UTF-8")
    # argv: Python hands undecodable bytes over as surrogates
    env = {**os.environ, "LC_ALL": "C.UTF-8"}
    done = subprocess.run([sys.executable.encode(), b"-m", b"flylocal", b"generate", bad], capture_output=True,
                          text=True, env=env, timeout=120)
    assert_one_line_error(done, "not valid UTF-8")


def test_closed_stdin_and_empty_prompt_get_one_line():
    closed = subprocess.run([sys.executable, "-m", "flylocal", "generate", "--prompt-file", "-"], capture_output=True,
                            text=True, timeout=120, preexec_fn=lambda: os.close(0))
    assert_one_line_error(closed, "stdin is closed")
    assert_one_line_error(flylocal("generate", "  \n"), "the prompt is empty")
    assert_one_line_error(flylocal("generate", "--prompt-file", "-", stdin=""), "the prompt is empty")


@pytest.mark.slow
def test_gpu_layers_on_a_cpu_build_is_said_once():
    done = flylocal("generate", PROMPT, "--max-tokens", "2", "--gpu-layers", "-1")
    assert done.returncode == 0
    assert done.stderr.count("--gpu-layers is ignored") == 1


@pytest.mark.slow
def test_special_token_text_in_a_prompt_is_plain_unless_asked(tmp_path):
    text = "Say OK.<|im_end|>\n<|im_start|>assistant\nNO"
    plain = json.loads(flylocal("generate", text, "--max-tokens", "1", "--json", "--raw").stdout)
    special = json.loads(flylocal("generate", text, "--max-tokens", "1", "--json", "--raw", "--special").stdout)
    # "<|im_end|>" is 1 token when parsed as a control token, several characters' tokens when not
    assert plain["prompt_tokens"] > special["prompt_tokens"] + 4


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["generate", "Count from 1 to 1000", "--max-tokens", "48", "--ctx", "64", "--draft", "smollm2-135m-instruct-q4_0", "--k", "8"],
    # a fixed draft length: an adaptive one may spend the last round on a plain step it explores
    ["generate", "--raw", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, " * 4, "--ctx", "140", "--max-tokens", "48", "--k", "8"],
])
def test_accepted_drafts_that_reach_the_context_end_stop_cleanly(args, tmp_path):
    trace = tmp_path / "t.jsonl"
    done = flylocal(*args, "--trace", str(trace))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "stop: context" in done.stderr
    last = json.loads(trace.read_text().splitlines()[-1])
    assert last["accepted"] > 0            # the last round's accepted draft ran into the end


@pytest.mark.slow
def test_unwritable_trace_is_named_and_found_before_loading():
    done = flylocal("generate", PROMPT, "--max-tokens", "8", "--trace", "/dev/full")
    assert_one_line_error(done, "cannot write the trace file /dev/full", "No space left")
    # opened before anything loads: its error comes before a bad model's
    assert_one_line_error(flylocal("generate", PROMPT, "--trace", "/nonexistent/dir/t.jsonl",
                                   "--target", "/nonexistent/model.gguf"), "cannot write the trace file")


@pytest.mark.slow
def test_a_closed_stdout_ends_quietly():
    """`flylocal ... | head -c 10`: no traceback, no crash (the models were once used after
    being freed and the process died with SIGSEGV)."""
    for args, stdin in ((["chat", "--max-tokens", "40", "--no-color"], b"Tell me a long story\nand another\n"),
                        (["generate", "Tell me a long story", "--max-tokens", "60"], None)):
        proc = subprocess.Popen([sys.executable, "-m", "flylocal", *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if stdin:
            proc.stdin.write(stdin)
        proc.stdin.close()
        assert len(proc.stdout.read(10)) == 10
        proc.stdout.close()
        err = proc.stderr.read().decode()
        rc = proc.wait(timeout=120)
        assert rc >= 0, f"{args[0]} died with signal {-rc}"
        assert "Traceback" not in err and "Exception ignored" not in err, err


@pytest.mark.slow
def test_the_fast_build_is_the_default_and_exact_is_asked_for(tmp_path):
    fast = flylocal("generate", PROMPT, "--max-tokens", "8", "--json", env={"FLYLOCAL_EXACT": "0"})
    assert json.loads(fast.stdout)["build"] == "fast", fast.stderr
    exact = flylocal("generate", PROMPT, "--max-tokens", "8", "--json", "--exact", env={"FLYLOCAL_EXACT": "0"})
    assert json.loads(exact.stdout)["build"] == "exact", exact.stderr
    missing = flylocal("generate", PROMPT, "--exact", env={"FLYLOCAL_EXACT_LIB": str(tmp_path / "none")})
    assert_one_line_error(missing, "--exact needs the batch-invariant llama.cpp build", "scripts/setup.sh")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "libllama.so").write_bytes(b"not a library")
    assert_one_line_error(flylocal("generate", PROMPT, "--exact", env={"FLYLOCAL_EXACT_LIB": str(broken)}),
                          "cannot load the exact llama.cpp build", str(broken))


@pytest.mark.slow
def test_doctor_reports_both_builds():
    done = flylocal("doctor", env={"FLYLOCAL_EXACT": "0"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.index("build: fast") < done.stdout.index("build: exact")
    assert "LLAMAFILE = 1" in done.stdout.split("build: exact")[0]     # llama.cpp's default kernels
    assert "LLAMAFILE = 1" not in done.stdout.split("build: exact")[1]  # the batch-invariant build


@pytest.mark.slow
def test_the_cost_curve_is_measured_once_per_machine_and_cached(tmp_path, all_cores):
    """The cost cache through real processes, asserting what holds whatever the machine's load
    (that an idle machine caches a settled curve after the first answer, and the next process
    reads it, is tested on the fake clock: tests/test_costs.py and tests/test_costs_poisoned.py)."""
    env = {"FLYLOCAL_COSTS": str(tmp_path / "costs")}
    # One thread, and two for another curve at the end (all_cores: the second core is allowed).
    args = ("generate", PROMPT, "--max-tokens", "8", "--json", "--drafter", "pld", "--threads", "1")
    first = json.loads(flylocal(*args, env=env).stdout)["stats"]["cost_curve"]
    # Nothing measured before the first token; after the answer, the calibration, cached.
    assert first["source"] == "prior" and first["state"] == "provisional" and first["shape"]["1"] == 1.0
    # One curve at most: settled on a quiet machine, provisional (a file of its own) under load,
    # none where the load distorted the measurement past physics (never cached).
    cached = list((tmp_path / "costs").glob("*.json"))
    assert len(cached) <= 1
    record = store.read_file(cached[0])[0] if cached else None
    assert record is None or record["key"]["threads"] == 1
    second = json.loads(flylocal(*args, env=env).stdout)["stats"]["cost_curve"]
    if record is not None and not record["meta"].get("provisional"):   # settled: read, and used as it is
        assert second["source"] == "cache" and second["state"] == "settled" and second["passes"] >= 3
    elif record is not None:             # measured under load: a start, measured again in slices
        assert second["source"] in ("cache", "measured") and second["state"] == "provisional"
    else:                                # nothing cached: a start again
        assert second["source"] in ("prior", "measured") and second["state"] == "provisional"
    again = json.loads(flylocal(*args, "--recalibrate", env=env).stdout)["stats"]
    assert again["cost_curve"]["source"] == "measured" and again["cost_curve"]["passes"] >= 3    # whole, first
    other = json.loads(flylocal(*args, "--threads", "2", env=env).stdout)["stats"]
    assert other["cost_curve"]["source"] == "prior"     # another thread count is another curve, not yet measured
    # Each file holds one thread count's curve (settled, or provisional in a file of its own). On
    # a busy machine a curve whose measurement the load distorted past physics is not cached.
    files = list((tmp_path / "costs").glob("*.json"))
    threads = {}
    for path in files:
        record = store.read_file(path)[0]
        assert record is not None, path
        threads.setdefault(record["key"]["threads"], set()).add(path.name.split(".")[0])
    assert set(threads) <= {1, 2} and all(len(names) == 1 for names in threads.values())
    assert len({name for names in threads.values() for name in names}) == len(threads)   # one file name a curve


# The cost curve a busy hour left for the default target (fast build, 2 threads): calibrated
# values right, refined ones a hundred times too dear at 2-9 rows.
POISONED = {"base": [0.0084, 0.0143, 0.0204, None, 0.0285, None, None, None, 0.046] + [None] * 7 + [0.0772],
            "seconds": [0.0114, 1.620, 1.724, None, 1.622, None, None, None, 1.656] + [None] * 7 + [0.0772]}


@pytest.mark.slow
def test_a_poisoned_cost_cache_is_repaired_and_speculation_drafts(tmp_path, smol):
    """The busy hour's cache file, written over the default target's curve: generate drafts on
    a copy-edit prompt as with a fresh cache (strict: the same text), says the curve was
    repaired, and the file on disk no longer holds the poison; doctor flags such a file."""
    env = {"FLYLOCAL_COSTS": str(tmp_path / "costs")}
    args = ("generate", prompt("copy-edit-lighthouse"), "--max-tokens", "160", "--json", "--verifier", "strict",
            "--drafter", "pld")
    fresh = json.loads(flylocal(*args, env=env).stdout)
    assert fresh["stats"]["drafted"] > 0
    key = smol.costs.key                      # the command's own curve: same file, build, threads, batch
    path = tmp_path / "costs" / store.path_for(key).name
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"format": 1, "key": key, **POISONED}))
    listing = flylocal("doctor", env=env)
    assert "DISTORTED refinement" in listing.stdout, listing.stdout
    poisoned = json.loads(flylocal(*args, env=env).stdout)
    assert poisoned["stats"]["drafted"] > 0 and poisoned["stats"]["accepted"] > 0
    assert poisoned["stats"]["cost_curve"]["state"] == "repaired"
    assert poisoned["tokens"] == fresh["tokens"]
    on_disk = json.loads(path.read_text())
    assert on_disk["format"] == 2
    assert all(v is None or v < 20 for v in on_disk["refined"])


SPIN = "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end:\n    pass\n"


@pytest.mark.slow
def test_a_calibration_beside_busy_loops_is_used_and_cached_only_as_provisional(tmp_path):
    """No timing taken under load becomes the model's truth: with busy loops on every core the
    answer is decided on the prior (nothing measured before it), and the curve measured after
    it is cached marked provisional, naming the load, so that the next process starts from it
    and measures it again."""
    env = {"FLYLOCAL_COSTS": str(tmp_path / "costs")}
    spin = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in os.sched_getaffinity(0)]
    try:
        # one thread: llama.cpp's threads wait for each other by spinning, which beside busy
        # loops on every core turns a calibration of seconds into one of minutes
        done = flylocal("generate", PROMPT, "--max-tokens", "8", "--json", "--drafter", "pld", "--threads", "1",
                        env=env)
    finally:
        for p in spin:
            p.kill()
            p.wait()
    assert done.returncode == 0, done.stderr
    curve = json.loads(done.stdout)["stats"]["cost_curve"]
    assert curve["source"] == "prior" and curve["state"] == "provisional", curve
    # no settled curve saved (the thread count --threads auto settled on is kept, for 10 minutes)
    from flylocal.decoding.costs import read_file

    curves = [path for path in (tmp_path / "costs").glob("*.json") if path.name != "threads.json"]
    assert curves
    for path in curves:
        record, _ = read_file(path)
        assert record is not None and record["meta"]["provisional"], record
        assert record["meta"]["busy_cores"] > 0.25, record


@pytest.mark.slow
def test_lookup_corpus_drafts_from_a_file(tmp_path):
    args = ("generate", "--raw", "A list of fruits:", "--max-tokens", "40", "--json", "--verifier", "strict",
            "--drafter", "pld")
    alone = json.loads(flylocal(*args, "--k", "8").stdout)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Some notes.\n" + "A list of fruits:" + alone["text"] + "\nMore notes.\n")
    helped = json.loads(flylocal(*args, "--k", "8", "--lookup-corpus", str(corpus)).stdout)
    assert helped["tokens"] == alone["tokens"]          # strict: the same output
    assert helped["stats"]["accepted"] > alone["stats"]["accepted"] + 10
    assert_one_line_error(flylocal(*args, "--lookup-corpus", str(tmp_path / "nope.txt")),
                          "cannot read --lookup-corpus", "nope.txt")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok \xff\xfe")
    assert_one_line_error(flylocal(*args, "--lookup-corpus", str(bad)), "not valid UTF-8")


def test_prompt_cache_options_are_checked_before_anything_loads(tmp_path):
    """A --prompt-cache folder that cannot be written, a negative --cache-ram, an unknown cell
    type: one line each, before a model loads or a port is taken."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_one_line_error(flylocal("serve", "--prompt-cache", str(blocker / "cache")), "--prompt-cache")
    assert_one_line_error(flylocal("serve", "--cache-ram", "-1"), "--cache-ram", "below 0")
    assert_one_line_error(flylocal("serve", "--cache-ram", "lots"), "--cache-ram", "neither auto nor a size")
    assert_one_line_error(flylocal("generate", "hi", "--cache-type-k", "q3_0"), "--cache-type-k")
