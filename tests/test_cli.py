"""The `flylocal` command end to end, in subprocesses: output contracts and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import GEMMA_Q8_0, SMOL, model_path

PROMPT = "Name three colours."


def flylocal(*args, stdin=None, env=None):
    return subprocess.run([sys.executable, "-m", "flylocal", *args], capture_output=True, text=True,
                          input=stdin, env={**os.environ, **(env or {})}, timeout=300)


def assert_one_line_error(done, *words):
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("flylocal: error: ")
    for w in words:
        assert w in lines[0], lines[0]


def test_json_output_contract():
    done = flylocal("generate", PROMPT, "--max-tokens", "24", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert set(out) == {"text", "tokens", "prompt_tokens", "stats"}
    assert out["text"] and len(out["tokens"]) <= 24 and out["prompt_tokens"] > 5
    for key in ("rounds", "drafted", "accepted", "loose", "emitted", "mean_accepted_length",
                "prefill_s", "wall_s", "target_s", "draft_s", "verify_s", "tokens_per_s"):
        assert key in out["stats"]


def test_streamed_text_equals_json_text_and_stats_go_to_stderr():
    streamed = flylocal("generate", PROMPT, "--max-tokens", "24", "--drafter", "none")
    as_json = json.loads(flylocal("generate", PROMPT, "--max-tokens", "24", "--json").stdout)
    assert streamed.returncode == 0
    assert streamed.stdout == as_json["text"] + "\n"
    assert "tok/s" in streamed.stderr and "mean accepted length" in streamed.stderr


def test_prompt_file_and_stdin(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text(PROMPT)
    a = json.loads(flylocal("generate", "--prompt-file", str(f), "--max-tokens", "8", "--json").stdout)
    b = json.loads(flylocal("generate", "--prompt-file", "-", "--max-tokens", "8", "--json", stdin=PROMPT).stdout)
    assert a["tokens"] == b["tokens"]


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
        assert all((reg == 0) == (d[j] == a[j]) for j, reg in enumerate(r["regret"]) if d[j] == a[j])
    assert [t for r in rows for t in r["emitted"]][: len(out["tokens"])] == out["tokens"]


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
    (["--draft", GEMMA_Q8_0, "--drafter", "model"], ["incompatible", "gemma-3-270m-q8_0", "smollm2-135m-instruct"]),
    (["--ctx", "32"], ["longer than the context", "--ctx 32"]),
    (["--temperature", "-0.5"], ["--temperature"]),
    (["--top-p", "0"], ["--top-p"]),
    (["--min-p", "1.5"], ["--min-p"]),
    (["--repeat-penalty", "0"], ["--repeat-penalty"]),
])
def test_bad_input_gets_one_line(args, words):
    assert_one_line_error(flylocal("generate", PROMPT * 5, *args), *words)


def test_bad_model_files(tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    assert_one_line_error(flylocal("generate", PROMPT, "--target", str(text)), "not a GGUF file")
    truncated = tmp_path / "truncated.gguf"
    with open(model_path(SMOL), "rb") as f:
        truncated.write_bytes(f.read(4 << 20))
    assert_one_line_error(flylocal("generate", PROMPT, "--target", str(truncated)), "cannot load", "truncated.gguf")


def test_unwritable_trace_file():
    assert_one_line_error(flylocal("generate", PROMPT, "--max-tokens", "2", "--trace", "/nonexistent/dir/t.jsonl"),
                          "cannot write the trace file")


def test_no_prompt():
    assert_one_line_error(flylocal("generate"), "no prompt")


def test_models_commands():
    listed = flylocal("models", "list")
    assert listed.returncode == 0 and SMOL in listed.stdout and "fetched" in listed.stdout
    path = flylocal("models", "path", SMOL)
    assert path.stdout.strip() == str(model_path(SMOL))
    assert_one_line_error(flylocal("models", "path", "nope"), "unknown model")


def test_doctor_reports_build_and_invariance():
    done = flylocal("doctor", "--model", SMOL)
    assert done.returncode == 0, done.stderr
    assert "llama-cpp-python" in done.stdout and "system:" in done.stdout
    assert "batch-invariant: yes" in done.stdout
