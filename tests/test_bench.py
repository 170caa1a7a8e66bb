"""`flylocal bench` on real models, kept small: few prompts, few tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flylocal.bench import METHODS, Prompt, humaneval_prompts, passes, stop_code
from test_cli import assert_one_line_error

STRICT = ("autoregressive", "strict-pld", "strict-model", "strict-mla")


def bench(*args):
    return subprocess.run([sys.executable, "-m", "flylocal", "bench", *args], capture_output=True, text=True,
                          timeout=600, env=os.environ)


@pytest.fixture(scope="module")
def prompts_jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "prompts.jsonl"
    rows = [{"prompt": "What is the capital of France? Answer in one word.", "answers": ["Paris"]},
            {"prompt": "Repeat exactly: one two three four five six."}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_every_method_gets_a_row_and_strict_methods_agree(prompts_jsonl, tmp_path):
    out = tmp_path / "out"
    done = bench("--draft", "smollm2-135m-instruct-q4_0", "--prompts", str(prompts_jsonl), "--max-tokens", "12",
                 "--out", str(out))
    assert done.returncode == 0, done.stderr
    results = json.loads((out / "results.json").read_text())
    rows = {r["method"]: r for r in results["methods"]}
    assert list(rows) == list(METHODS)
    for m in STRICT:
        assert rows[m]["agreement"] == 1.0, m
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and r["target_nll"] > 0 and r["accuracy"] is not None
    assert rows["autoregressive"]["speedup"] == 1.0
    assert rows["autoregressive"]["accuracy"] == 1.0          # "Paris" is in the answer
    assert rows["fly-model"]["mean_accepted_length"] >= 1.0
    assert {"machine", "config"} <= set(results)
    assert "| autoregressive |" in (out / "report.md").read_text()
    assert (out / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_draft_the_draft_methods_are_skipped_and_said(tmp_path):
    prompts = tmp_path / "p"
    prompts.mkdir()
    (prompts / "a.txt").write_text("Name a colour.")
    done = bench("--prompts", str(prompts), "--max-tokens", "6", "--out", str(tmp_path / "o"),
                 "--methods", "autoregressive,strict-pld,fly-model")
    assert done.returncode == 0, done.stderr
    assert "skipping fly-model" in done.stderr
    rows = json.loads((tmp_path / "o" / "results.json").read_text())["methods"]
    assert [r["method"] for r in rows] == ["autoregressive", "strict-pld"]
    assert rows[1]["agreement"] == 1.0 and rows[0]["accuracy"] is None


def test_bad_input(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_line_error(bench("--prompts", str(empty), "--out", str(tmp_path / "o")), "no prompts")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    assert_one_line_error(bench("--prompts", str(bad), "--out", str(tmp_path / "o")), "bad.jsonl:2")
    bad.write_text("not json\n")
    assert_one_line_error(bench("--prompts", str(bad), "--out", str(tmp_path / "o")), "not valid JSON")
    (empty / "a.txt").write_text("hi")
    assert_one_line_error(bench("--prompts", str(empty), "--out", str(tmp_path / "o"), "--methods", "warp-drive"),
                          "unknown method 'warp-drive'")


def test_humaneval_execution_judges_completions():
    problem = humaneval_prompts(1)[0]
    assert problem.id == "HumanEval/0"
    right = ("    for i, a in enumerate(numbers):\n        for j, b in enumerate(numbers):\n"
             "            if i != j and abs(a - b) < threshold:\n                return True\n    return False\n")
    assert passes(problem, right)
    assert not passes(problem, "    return False\n")
    assert not passes(Prompt("x", "def f():\n", test="def check(f):\n    f()\n", entry_point="f"),
                      "    while True:\n        pass\n", timeout=1.0)
    assert stop_code("    return 1\n\ndef other():\n    pass") == "    return 1\n"


def test_humaneval_run_reports_pass_at_1(tmp_path):
    done = bench("--humaneval", "--humaneval-limit", "2", "--methods", "autoregressive,strict-pld",
                 "--max-tokens", "48", "--out", str(tmp_path / "he"))
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "he" / "results.json").read_text())["methods"]
    assert all(0.0 <= r["pass_at_1"] <= 1.0 for r in rows)
    assert rows[1]["agreement"] == 1.0
