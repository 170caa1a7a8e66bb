"""`flylocal bench` on real models, kept small: few prompts, few tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flylocal.errors import FlylocalError
from flylocal.front import bench as b
from flylocal.front.bench import METHODS, Prompt, humaneval_prompts, passes, stop_code
from flylocal.front.bench.sandbox import ADDRESS_SPACE, run_python
from conftest import SMOL, model_path
from test_cli import assert_one_line_error

STRICT = ("autoregressive", "strict-pld", "strict-model", "strict-mla")
LONG_TEXT = ("Summarise the following text in two sentences.\n\n" + (
    "The quarterly report describes revenue growth in three regions, with costs rising faster than "
    "expected in the north and staffing changes in the south. ") * 26)


# Two threads at most: llama.cpp's threads wait for each other by spinning, so more threads
# than free cores turn seconds into minutes. This process only waits while a bench runs, so
# two cores are the bench's (40% faster than one, measured); these tests check behaviour, not speed.
BENCH_THREADS = str(min(2, len(os.sched_getaffinity(0))))


def bench(*args):
    return subprocess.run([sys.executable, "-m", "flylocal", "bench", "--threads", BENCH_THREADS, *args],
                          capture_output=True, text=True, timeout=600, env=os.environ)


def main_in_subprocess(*args):
    """Run flylocal's main(args) in a fresh interpreter; returns (completed process, whether
    llama_cpp had been imported by the time main returned)."""
    code = ("import sys\nfrom flylocal.front.cli import main\nrc = main(sys.argv[1:])\n"
            "print('LLAMA_CPP_LOADED' if 'llama_cpp' in sys.modules else 'LLAMA_CPP_NOT_LOADED')\nsys.exit(rc)\n")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    marker = done.stdout.strip().splitlines()[-1]
    assert marker in ("LLAMA_CPP_LOADED", "LLAMA_CPP_NOT_LOADED"), done.stdout + done.stderr
    return done, marker == "LLAMA_CPP_LOADED"


def alive_with(marker: str) -> list[int]:
    """Live (non-zombie) processes whose command line contains `marker`."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{d}/cmdline").read_bytes()
            state = Path(f"/proc/{d}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state not in (b"Z", b"X"):
            found.append(int(d))
    return found


def results_doc(methods: list[dict]) -> dict:
    return {"methods": methods, "machine": b.machine_info({"llama_cpp_python": "x", "gpu_offload": False}),
            "config": {"target": "t", "draft": None, "source": "s", "prompts": 2, "max_tokens": 8, "repeat": 2}}


@pytest.fixture(scope="module")
def smol():
    """The target in this process, on one thread (see bench())."""
    from flylocal.llama.runtime import Runtime, RuntimeConfig

    rt = Runtime(model_path(SMOL), RuntimeConfig(n_ctx=2048, n_threads=1))
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def prompts_jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "prompts.jsonl"
    rows = [{"prompt": "What is the capital of France? Answer in one word.", "answers": ["Paris"]},
            {"prompt": "Repeat exactly: one two three four five six."}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.slow
def test_every_method_gets_a_row_and_strict_methods_agree(prompts_jsonl, tmp_path):
    out = tmp_path / "out"
    # --k fixed: adaptive draft lengths follow measured timings, which makes acceptance vary
    done = bench("--draft", "smollm2-135m-instruct-q4_0", "--prompts", str(prompts_jsonl), "--max-tokens", "12",
                 "--k", "6", "--out", str(out))
    assert done.returncode == 0, done.stderr
    results = json.loads((out / "results.json").read_text())
    rows = {r["method"]: r for r in results["methods"]}
    assert list(rows) == list(METHODS)
    for m in STRICT:
        assert rows[m]["agreement"] == 1.0, m
    for r in rows.values():
        assert r["failures"] == [] and r["completed"] == 2, r
        assert r["tokens_per_s"] > 0 and r["target_nll"] > 0
    assert rows["autoregressive"]["accuracy"] == 1.0          # "Paris" is in the answer
    answers = {(r["prompt"], r["method"]): r["answer"] for r in results["prompts"]}
    assert len(answers) == 2 * len(METHODS)                   # every answer, to read side by side
    assert all("Paris" in a for (p, m), a in answers.items() if p == "1" and m in STRICT), answers
    # One emitted token per round is what a drafter that proposes nothing, or a verifier that
    # accepts nothing, gives. A Q4_0 copy of the target as draft is accepted most of the time
    # (3.6 tokens per round measured), and prompt lookup finds the words to repeat (2.0).
    assert rows["autoregressive"]["mean_accepted_length"] == 1.0
    for m in ("strict-model", "fly-model", "asd-model", "strict-mla", "fly-mla", "asd-mla"):
        assert rows[m]["mean_accepted_length"] > 2.5, (m, rows[m])
    for m in ("strict-pld", "fly-pld"):
        assert rows[m]["mean_accepted_length"] > 1.5, (m, rows[m])
    assert "| autoregressive |" in (out / "report.md").read_text()
    assert (out / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
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
    out = str(tmp_path / "o")
    assert_one_line_error(bench("--prompts", str(empty), "--out", out), "no prompts")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    assert_one_line_error(bench("--prompts", str(bad), "--out", out), "bad.jsonl:2")
    bad.write_text("not json\n")
    assert_one_line_error(bench("--prompts", str(bad), "--out", out), "not valid JSON")
    bad.write_bytes(b'{"prompt": "ok"}\n\n{"prompt": "caf\xe9"}\n')
    assert_one_line_error(bench("--prompts", str(bad), "--out", out), f"{bad}:3", "not valid UTF-8")
    bad.write_text('{"id": "x", "prompt": "a"}\n{"id": "x", "prompt": "b"}\n')
    assert_one_line_error(bench("--prompts", str(bad), "--out", out), "bad.jsonl:2", "'x'")
    (empty / "a.txt").write_text("hi")
    assert_one_line_error(bench("--prompts", str(empty), "--out", out, "--methods", "warp-drive"),
                          "unknown method 'warp-drive'")
    (empty / "b.txt").write_bytes(b"caf\xe9\n")
    assert_one_line_error(bench("--prompts", str(empty), "--out", out), str(empty / "b.txt"), "not valid UTF-8")
    assert_one_line_error(bench("--prompts", str(bad), "--out", out, "--ctx", "10"), "--ctx")
    assert_one_line_error(bench("--prompts", str(bad), "--out", out, "--execute"), "--humaneval")
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "Hi."}\n')
    assert_one_line_error(bench("--prompts", str(good), "--out", out, "--methods", "autoregressive", "--k", "600"), "--k 600")


@pytest.mark.slow
def test_a_prompt_longer_than_ctx_is_caught_before_anything_runs(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hi."}) + "\n" + json.dumps({"prompt": LONG_TEXT}) + "\n")
    done = bench("--prompts", str(prompts), "--methods", "autoregressive", "--ctx", "256", "--max-tokens", "4", "--out", str(tmp_path / "o"))
    assert_one_line_error(done, f"{prompts}:2", "--ctx 256")      # one line: no progress, nothing ran
    assert not (tmp_path / "o" / "results.json").exists()
    done = bench("--humaneval", "--humaneval-limit", "3", "--methods", "autoregressive", "--execute", "--ctx", "64", "--out", str(tmp_path / "o"))
    assert_one_line_error(done, "HumanEval/0", "--ctx 64")
    prompts.write_text(json.dumps({"prompt": "Hi."}) + "\n" + json.dumps({"prompt": "  "}) + "\n")
    done = bench("--prompts", str(prompts), "--methods", "autoregressive", "--out", str(tmp_path / "o"))
    assert_one_line_error(done, f"{prompts}:2", "the prompt is empty")


def test_unusable_out_is_refused_before_any_model_is_loaded(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hi."}) + "\n")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for out in ("/dev/full", str(a_file), str(a_file / "sub")):
        done, loaded = main_in_subprocess("bench", "--prompts", str(prompts), "--out", out)
        assert done.returncode != 0 and not loaded, (out, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("flylocal: error: ") and out in lines[0], done.stderr
        assert "File exists" not in lines[0]
    assert a_file.read_text() == "x"
    with pytest.raises(FlylocalError, match="results.json"):
        b.write_results(tmp_path / "gone", results_doc([]))
    full = tmp_path / "full"                      # a disk that fills up while the results are written
    full.mkdir()
    (full / "results.json").symlink_to("/dev/full")
    with pytest.raises(FlylocalError, match=f"cannot write {full / 'results.json'}: No space left on device"):
        b.write_results(full, results_doc([]))


@pytest.mark.parametrize("args", [["--help"], ["bench", "--help"], ["models", "list"], ["generate", "--k", "-1", "hi"]])
def test_help_lists_and_option_errors_do_not_load_llama_cpp(args):
    done, loaded = main_in_subprocess(*args)
    assert not loaded, done.stderr
    if args[-1] == "hi":
        assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    else:
        assert done.returncode == 0, done.stderr
    if args == ["bench", "--help"]:
        text = " ".join(done.stdout.split())
        assert "llama-cpp-python-pld" in text and "--execute" in text and "not attacks" in text


def test_a_long_prompt_completes_with_llama_cpp_pythons_prompt_lookup(tmp_path, smol):
    from flylocal.loader import encode_prompt

    assert len(encode_prompt(smol, LONG_TEXT, raw=False)[0]) > 600       # past the baseline's n_batch of 512
    prompts = tmp_path / "p"
    prompts.mkdir()
    (prompts / "long.txt").write_text(LONG_TEXT)
    done = bench("--prompts", str(prompts), "--methods", "autoregressive,llama-cpp-python-pld", "--max-tokens", "6",
                 "--ctx", "1024", "--out", str(tmp_path / "o"))
    assert done.returncode == 0, done.stderr
    rows = {r["method"]: r for r in json.loads((tmp_path / "o" / "results.json").read_text())["methods"]}
    assert rows["llama-cpp-python-pld"]["failures"] == []
    assert rows["llama-cpp-python-pld"]["completed"] == 1 and rows["llama-cpp-python-pld"]["tokens_per_s"] > 0


class Failing:
    """A baseline that fails on the prompts it is told to, with a two-line message; on the others
    it gives flylocal's own autoregressive output, so agreement with autoregressive is 1."""

    def __init__(self, target, fail_on: set[int]):
        self.target, self.fail_on, self.calls = target, fail_on, []

    def generate(self, ids, max_tokens, sampling=None, reuse=False):
        from flylocal.decoding.engine import generate_all
        from flylocal.loader import build_engine
        from flylocal.settings import Settings

        self.calls.append(len(ids))
        if len(ids) in self.fail_on:
            raise RuntimeError("boom\nsecond line")
        settings = Settings(verifier="strict", drafter="none", max_tokens=max_tokens)
        self.target.reset()
        tokens, _, _ = generate_all(build_engine(settings, self.target, None), ids)
        return self.target.detokenize(tokens), len(tokens), 0.01, 0.01


def test_a_failing_method_is_recorded_and_the_run_goes_on(smol, tmp_path):
    from flylocal.loader import Models
    from flylocal.settings import Settings

    prompts = [Prompt("a", "What is the capital of France? Answer in one word.", answers=["Paris"]),
               Prompt("b", "Repeat exactly: one two three four five six.")]
    encoded = b.encode_all(smol, prompts)
    always, on_b = Failing(smol, {len(v) for v in encoded.values()}), Failing(smol, {len(encoded["b"])})
    assert len(encoded["a"]) != len(encoded["b"])
    methods = ["autoregressive", "llama-cpp-python", "llama-cpp-python-pld", "strict-pld"]
    warnings = []
    settings = Settings(max_tokens=8, ctx=smol.n_ctx)
    rows = b.run(settings, Models(settings, smol, None),
                 {"llama-cpp-python": always, "llama-cpp-python-pld": on_b}, prompts, methods, 2,
                 encoded=encoded, warn=warnings.append)
    assert len(always.calls) == 2 and len(on_b.calls) == 3        # a failed prompt is not run again
    results = {r["method"]: r for r in b.metrics(rows, prompts)}
    broken = results["llama-cpp-python"]
    assert [(f["prompt"], f["repeat"], f["error"]) for f in broken["failures"]] == [
        ("a", 1, "RuntimeError: boom"), ("b", 1, "RuntimeError: boom")]
    assert broken["completed"] == 0 and broken["tokens_per_s"] == 0.0
    assert broken["agreement"] is None and broken["accuracy"] is None and broken["target_nll"] is None
    half = results["llama-cpp-python-pld"]
    assert [f["prompt"] for f in half["failures"]] == ["b"] and half["completed"] == 1
    assert half["agreement"] == 1.0 and half["accuracy"] == 1.0 and half["target_nll"] > 0   # over prompt a
    for m in ("autoregressive", "strict-pld"):
        assert results[m]["failures"] == [] and results[m]["completed"] == 2 and results[m]["agreement"] == 1.0
    assert warnings == ["llama-cpp-python failed on a: RuntimeError: boom",
                        "llama-cpp-python failed on b: RuntimeError: boom",
                        "llama-cpp-python-pld failed on b: RuntimeError: boom"]

    report, _ = b.write_results(tmp_path, results_doc(list(results.values())))
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["methods"][1]["failures"][0]["error"] == "RuntimeError: boom"
    assert (tmp_path / "report.md").read_text() == report
    assert "## Failures" in report and "second line" not in report
    assert "- `llama-cpp-python-pld` on `b` (repeat 1): RuntimeError: boom" in report
    table = [line for line in report.splitlines() if line.startswith("| llama-cpp-python |")]
    assert len(table) == 2 and table[1].endswith("| 2 |")        # the "failed" column, in the details table


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


def test_a_completion_leaves_nothing_behind(tmp_path, monkeypatch):
    marker = f"301.{os.getpid()}"         # `sleep 301.PID`: findable in /proc, unique to this test run
    monkeypatch.setenv("FLYLOCAL_TEST_SECRET", "do-not-pass")
    monkeypatch.chdir(tmp_path)
    home = Path(os.path.expanduser("~"))
    name = f"flylocal-sandbox-test-{os.getpid()}"
    completion = textwrap.indent(textwrap.dedent(f"""\
        import os, resource, subprocess
        print("cwd", os.getcwd())
        print("home", os.environ["HOME"])
        print("secret" if "FLYLOCAL_TEST_SECRET" in os.environ else "no secret")
        print("as", resource.getrlimit(resource.RLIMIT_AS)[0])
        open(os.path.join(os.path.expanduser("~"), "{name}"), "w").write("x")
        open("{name}", "w").write("x")
        subprocess.Popen(["sleep", "{marker}"])
        subprocess.Popen(["sleep", "{marker}"], preexec_fn=lambda: os.setpgid(0, 0))
        subprocess.Popen(["sleep", "{marker}"], start_new_session=True)
        return 1
        """), "    ")
    program = f"def f():\n{completion}\n\nassert f() == 1\n"
    for timeout, tail in ((20.0, ""), (1.0, "import sys, time\nsys.stdout.flush()\ntime.sleep(60)\n")):
        outcome = run_python(program + tail, timeout)
        assert outcome.timed_out == bool(tail) and outcome.ok == (not tail), outcome
        lines = dict(line.split(" ", 1) for line in outcome.output.splitlines())
        assert lines["cwd"] == lines["home"] and Path(lines["cwd"]) != tmp_path
        assert "no secret" in outcome.output and lines["as"] == str(ADDRESS_SPACE)
        assert not Path(lines["cwd"]).exists()                      # the sandbox directory is removed
        assert not (home / name).exists() and not (tmp_path / name).exists()
        assert alive_with(marker) == []                             # no grandchild survives
    # the same through passes(), the function bench uses
    prompt = Prompt("x", "def f():\n", test="def check(f):\n    assert f() == 1\n", entry_point="f")
    assert passes(prompt, completion)
    assert not (home / name).exists() and not (tmp_path / name).exists() and alive_with(marker) == []


@pytest.mark.slow
def test_humaneval_pass_at_1_only_with_execute(tmp_path):
    done = bench("--humaneval", "--humaneval-limit", "2", "--methods", "autoregressive,strict-pld", "--execute",
                 "--max-tokens", "48", "--out", str(tmp_path / "he"))
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "he" / "results.json").read_text())["methods"]
    assert rows[1]["agreement"] == 1.0
    assert rows[0]["pass_at_1"] is not None and rows[0]["pass_at_1"] == rows[1]["pass_at_1"]   # same code, same verdict
    done = bench("--humaneval", "--humaneval-limit", "1", "--methods", "autoregressive", "--max-tokens", "4",
                 "--out", str(tmp_path / "no"))
    assert done.returncode == 0, done.stderr
    assert "will not be run" in done.stderr and "--execute" in done.stderr
    rows = json.loads((tmp_path / "no" / "results.json").read_text())["methods"]
    assert rows[0]["pass_at_1"] is None and rows[0]["completed"] == 1


SPEC_BENCH_ROWS = [
    {"question_id": 81, "category": "writing", "turns": ["Write one sentence about the sea.",
                                                           "Now rewrite it in capital letters."]},
    {"question_id": 82, "category": "roleplay", "turns": ["Say hello as a pirate.", "Now say goodbye."]},
    {"question_id": 201, "category": "translation", "turns": ["Translate to French: good morning."]},
    {"question_id": 301, "category": "qa", "turns": ["What is the capital of Italy?"]},
    {"question_id": 302, "category": "qa", "turns": ["What is the capital of Spain?"]},
]


@pytest.mark.slow
def test_spec_bench_questions_second_turns_and_category_tables(tmp_path):
    data = tmp_path / "spec_bench"
    data.mkdir()
    (data / "question.jsonl").write_text("".join(json.dumps(r) + "\n" for r in SPEC_BENCH_ROWS))
    out = tmp_path / "o"
    done = bench("--prompts", str(data), "--per-category", "1", "--methods", "autoregressive,strict-pld",
                 "--max-tokens", "8", "--repeat", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr
    results = json.loads((out / "results.json").read_text())
    # one per group: the multi-turn group's first (writing), translation's, qa's first
    assert results["config"]["prompts"] == 3
    assert {r["prompt"] for r in results["prompts"]} == {"81", "201", "301"}
    for row in results["methods"]:
        assert set(row["categories"]) == {"multi-turn", "translation", "qa"}
        assert row["e2e_speedup"] is not None and row["speedup"] is not None
    strict = next(r for r in results["methods"] if r["method"] == "strict-pld")
    assert strict["agreement"] == 1.0                   # every turn equal to autoregressive
    two_turns = next(r for r in results["prompts"] if r["prompt"] == "81" and r["method"] == "autoregressive")
    assert 8 < two_turns["tokens"] <= 16                 # the second turn ran, after the model's own answer
    report = (out / "report.md").read_text()
    assert "## Speedup by category, end to end" in report and "| multi-turn | translation | qa |" in report
    assert "## Per prompt" in report
    steps = [line for line in done.stderr.splitlines() if line.startswith("flylocal bench: [")]
    assert [line.split("]")[0] for line in steps] == [f"flylocal bench: [{i}/6" for i in range(1, 7)]  # stderr a pipe
    assert "strict-pld on 301" in steps[-1]


def test_per_group_takes_the_first_of_each_group_in_turn_from_its_categories():
    prompts = [b.Prompt(str(r["question_id"]), r["turns"][0], turns=r["turns"], category=r["category"])
               for r in SPEC_BENCH_ROWS]
    assert [p.id for p in b.per_group(prompts, 2)] == ["81", "82", "201", "301", "302"]
    assert [p.id for p in b.per_group(prompts, 1)] == ["81", "201", "301"]
    assert [p.group for p in prompts] == ["multi-turn", "multi-turn", "translation", "qa", "qa"]
    assert b.group_of("copy-edit") == "copy-edit" and b.group_of(None) is None   # other categories stand alone


def test_a_bad_spec_bench_row_is_named(tmp_path):
    bad = tmp_path / "q.jsonl"
    bad.write_text('{"question_id": 1, "category": "qa", "turns": []}\n')
    assert_one_line_error(bench("--prompts", str(bad), "--out", str(tmp_path / "o")), f"{bad}:1", "turns")


def test_the_standin_presets_prompts_are_questions_for_a_base_model():
    ps = b.prompts.standin_prompts(2)
    spec = [p for p in ps if p.id.startswith("sb-")]
    assert len(spec) == 12 and {p.group for p in spec} == {"multi-turn", "translation", "summarization", "qa",
                                                            "math_reasoning", "rag"}
    assert {p.category for p in ps if not p.id.startswith("sb-")} == {"copy-edit", "code-edit", "data-edit"}
    for p in ps:
        assert p.raw and p.text.startswith("Question: ") and p.text.endswith("\nAnswer:") and not p.turns


def test_the_instruct_standin_presets_prompts_go_through_the_chat_template():
    base, chat = b.prompts.standin_prompts(2), b.prompts.standin_prompts(2, base_model=False)
    assert [p.id for p in chat] == [p.id for p in base]
    for p, q in zip(chat, base):
        assert not p.raw and q.text == f"Question: {p.text}\nAnswer:"


@pytest.mark.slow
@pytest.mark.parametrize("preset,method,draft", [("standin", "strict-pld", "gemma-3-270m-q2_k"),
                                                  ("standin-instruct", "strict-mla", "smollm2-135m-instruct-q4_0")])
def test_the_standin_presets_run_and_the_command_line_wins(tmp_path, preset, method, draft):
    out = tmp_path / "o"
    done = bench("--preset", preset, "--target", SMOL, "--per-category", "1", "--methods",
                 f"autoregressive,{method}", "--max-tokens", "4", "--repeat", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr
    results = json.loads((out / "results.json").read_text())
    c = results["config"]
    assert c["preset"] == preset and c["target"] == SMOL and c["max_tokens"] == 4
    assert c["draft"] == draft                        # the preset's, where the command line gave none
    assert c["prompts"] == 9 and [r["method"] for r in results["methods"]] == ["autoregressive", method]
    assert f"{preset} preset" in (out / "report.md").read_text()
