"""The cost model: cost curves measured once and cached, a draft model that drafts only where
it pays, and lookup beyond the context. Fake cost curves stand in for machines: a CPU-like
one, where a row costs 40% of a step, and a GPU-like flat one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flylocal.decoding.adaptive import ModelDraftLength
from flylocal.decoding.costs import BUDGET, SWITCH_PRIOR, WAIT, CostCurve, costs_dir, store
from flylocal.decoding.costs import curve as curve_module
from flylocal.decoding.drafters.pld import Corpus, PromptLookup, find_match

KEY = {"model": "/m.gguf", "size": 1, "threads": 2}


def probe(calls, single=0.01, per_row=0.4):
    def timed(rows):
        calls.append(rows)
        return single * (1 + per_row * (rows - 1))
    return timed


@pytest.fixture
def costs(tmp_path, monkeypatch):
    monkeypatch.setenv("FLYLOCAL_COSTS", str(tmp_path / "costs"))
    return tmp_path / "costs"


def test_a_curve_is_measured_once_then_read_from_the_cache(costs):
    calls = []
    first = CostCurve(key=KEY)
    first.ensure(probe(calls), max_rows=11)
    assert first.source == "measured" and {1, 2, 3, 5, 9, 11, 17} <= set(calls)
    assert len(list(costs.glob("*.json"))) == 1
    n = len(calls)
    first.ensure(probe(calls), max_rows=11)            # within a process: never again
    assert len(calls) == n
    second = CostCurve(key=KEY)                         # another process, same key
    second.ensure(probe(calls), max_rows=11)
    assert len(calls) == n and second.source == "cache"
    assert np.allclose(second.cost(17), first.cost(17))
    other = CostCurve(key={**KEY, "threads": 1})        # another thread count is another curve
    other.ensure(probe(calls), max_rows=11)
    assert len(calls) > n and other.source == "measured"


def test_recalibrate_measures_again_and_a_bad_cache_file_is_measured_over(costs):
    calls = []
    CostCurve(key=KEY).ensure(probe(calls), max_rows=9)
    n = len(calls)
    again = CostCurve(key=KEY)
    again.ensure(probe(calls, single=0.02), max_rows=9, recalibrate=True)
    assert len(calls) > n and again.source == "measured"
    reread = CostCurve(key=KEY)
    reread.load()
    assert np.isclose(reread.cost(1)[0], 0.02)         # the new measurement replaced the old one
    for path in costs.glob("*.json"):
        path.write_text("{not json")
    broken = CostCurve(key=KEY)
    n = len(calls)
    broken.ensure(probe(calls), max_rows=9)
    assert len(calls) > n and broken.source == "measured"
    for path in costs.glob("*.json"):
        data = json.loads(path.read_text())
        data["calibration"]["seconds"][0] = -1.0
        path.write_text(json.dumps(data))
    assert not CostCurve(key=KEY).load()               # a negative time is not a curve


def test_rounds_refine_the_shape_and_a_consistent_refinement_is_saved(costs):
    """A 9-row round costs 3 single-row rounds where the calibration said 4.2: after a few,
    the shape says 3, and the lower quartile of the agreeing samples is saved with the curve."""
    curve = CostCurve(key=KEY)
    curve.ensure(probe([]), max_rows=9)
    assert curve.shape(9) == pytest.approx(4.2)
    for _ in range(9):
        curve.update(1, 0.01)
        curve.update(9, 0.03 * (1 + 0.01 * (_ % 3)))
    assert curve.shape(9) == pytest.approx(3.03) and curve.dirty
    curve.save()
    again = CostCurve(key=KEY)
    assert again.load() and again.shape(9) == pytest.approx(3.0)
    assert again.calibrated_step() == pytest.approx(0.01)        # the calibration stands beside it


def test_interpolation_and_growth_past_the_largest_size():
    curve = CostCurve(seconds=[0.01, 0.02, np.nan, 0.03])
    cost = curve.cost(6)
    assert np.allclose(cost[:4], [0.01, 0.02, 0.025, 0.03])
    assert np.allclose(cost[4:], [0.035, 0.04])        # the last measured slope
    # the prior's shape, and the prior cost of changing the row count back after a draft
    assert np.allclose(CostCurve().cost(3), 0.01 * (np.array([1.0, 1.4, 1.8]) + [0, SWITCH_PRIOR, SWITCH_PRIOR]))


def cpu_like(single=0.01):
    """A 2-core CPU: each row costs 40% of a step, and a draft step costs what a target step does."""
    target = CostCurve(seconds=single * (1 + 0.4 * np.arange(17)), fixed=True)
    draft = CostCurve(seconds=single * (1 + 0.4 * np.arange(17)), fixed=True)
    return target, draft


def gpu_like(single=0.01):
    """A GPU: verifying 17 rows costs what 1 does, and the draft is 20x cheaper than the target."""
    target = CostCurve(seconds=np.full(17, single), fixed=True)
    draft = CostCurve(seconds=np.full(17, single / 20), fixed=True)
    return target, draft


def test_a_draft_model_that_costs_a_target_step_never_drafts():
    plan = ModelDraftLength(8, *cpu_like())
    rate, k = plan.best(8)
    assert k == 0 and np.isclose(rate, 1 / 0.01)       # a plain step is best
    for _ in range(50):                                 # even a draft that is always right
        plan.observe([5] * 8, 8, 0.08)
    assert plan.best(8)[1] == 0


def test_a_cheap_draft_on_a_flat_curve_drafts_long():
    plan = ModelDraftLength(8, *gpu_like())
    rate, k = plan.best(8)
    assert k >= 3 and rate > 1.5 / 0.01                 # at the prior's mean acceptance
    assert all(plan.keep_going([5] * j, 0.99) for j in range(8))    # confident tokens: on to k
    for _ in range(20):
        plan.observe([5] * 8, 8, 0.004)
    assert plan.best(8)[1] == 8                         # measured acceptance: the whole length
    for _ in range(80):                                 # drafts that are all rejected bring it down
        plan.observe([0, 0, 0, 0], 0, 0.002)
    assert plan.best(8)[1] < 3


def test_a_draft_models_prefill_must_be_paid_for_by_the_answer():
    """`window`: how many context tokens a request's draft-model prefill may evaluate. What its
    drafts are expected to save over plain steps across the answer pays for it twice over, at
    the prior cost per token (a third of a draft step) until a prefill is measured."""
    plan = ModelDraftLength(8, *gpu_like())
    assert plan.prefill_s() == pytest.approx(0.3 * 0.0005)
    rate, k = plan.best(8)
    saved_per_token = 1 / 100 - 1 / rate                # a plain step is 0.01 s
    short, long = plan.window(8, 4), plan.window(8, 64)
    assert long == int(64 * saved_per_token / (2 * plan.prefill_s()))
    assert 0 < short < long and abs(long / short - 16) < 0.5       # in proportion to the answer
    assert ModelDraftLength(8, *cpu_like()).window(8, 10_000) == 0     # drafts that never pay: no prefill
    for _ in range(5):                                  # answers end after 4 tokens: the budget does not count
        plan.answered(4)
    assert plan.window(8, 64) == short
    # A measured prefill replaces the prior (curves that follow timings, not fixed ones).
    target = CostCurve(seconds=np.full(17, 0.01))
    draft = CostCurve(seconds=np.full(17, 0.0005))
    measured = ModelDraftLength(8, target, draft)
    before = measured.window(8, 64)
    measured.prefilled(8, 1.0)                          # too few tokens to say anything
    assert measured.window(8, 64) == before
    measured.prefilled(100, 0.1)                        # 1 ms a token: a tenth of a target step
    assert measured.prefill_s() == pytest.approx(0.001)
    assert abs(measured.window(8, 64) - before * 0.3 * 0.0005 / 0.001) <= 1


def test_a_draft_models_prefill_pays_only_for_what_prompt_lookup_does_not_do_already():
    """The model saves only in rounds where it beats prompt lookup alone (or a plain step):
    where lookup has offered as much as the model's drafts, its prefill does not pay; where it
    offered plain steps, the prefill pays as before; half and half, half as much."""
    plan = ModelDraftLength(8, *gpu_like())
    rate, _ = plan.best(8)
    before = plan.window(8, 64)
    assert before > 0
    for _ in range(64):
        plan.looked(np.array([100.0, 80.0]))           # lookup's drafts worse than a plain step: plain
    assert plan.window(8, 64) == before
    for _ in range(64):
        plan.looked(np.array([100.0, rate * 1.01]))    # lookup as fast as the model: nothing to save
    assert plan.window(8, 64) == 0
    for i in range(64):
        plan.looked(np.array([100.0, 90.0 if i % 2 else rate]))
    assert abs(plan.window(8, 64) - before / 2) <= 1


def test_a_draft_model_not_measured_yet_costs_a_target_step():
    """A draft curve whose first slice is still to come is no cheaper than the target: the
    model is not asked (prompt lookup alone) until its cost is measured."""
    target = CostCurve(seconds=np.full(17, 0.05))             # flat: rows are free; a step unlike the prior's
    draft = CostCurve(key={"model": "/draft.gguf"})           # nothing measured
    plan = ModelDraftLength(8, target, draft)
    assert plan.step_s() == pytest.approx(0.05) and plan.best(8)[1] == 0 and plan.window(8, 1000) == 0
    draft.calibrate(lambda rows: 0.0005 * (1 + 0.4 * (rows - 1)), max_rows=2)
    assert plan.step_s() == pytest.approx(0.0005) and plan.best(8)[1] > 0 and plan.window(8, 1000) > 0


def test_p_min_ends_a_draft_and_keep_going_weighs_the_next_token():
    plan = ModelDraftLength(8, *gpu_like(), p_min=0.6)
    assert not plan.keep_going([], 0.59) and plan.keep_going([], 0.61)
    steep = ModelDraftLength(8, CostCurve(seconds=0.01 * (1 + 0.4 * np.arange(17)), fixed=True),
                             CostCurve(seconds=np.full(17, 0.0005), fixed=True))
    assert steep.keep_going([5], 0.99)                  # one more confident token still pays
    assert not steep.keep_going([5, 0, 0], 0.1)         # after two unlikely ones, another does not


def test_the_model_drafter_weighs_the_model_against_lookup(smol, smol_draft):
    """The round's choice, on real models with fake cost curves: on a CPU-like curve the draft
    model is never asked and prompt lookup (or a plain step) drafts; on a GPU-like curve the
    model drafts, long, from the request's second round on (the first never waits for the
    draft's prefill)."""
    from flylocal.decoding.drafters.model import ModelDrafter

    ids = smol.tokenize_chat([{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog."}])
    saved = smol.costs, smol_draft.costs
    try:
        for curves, expect in ((cpu_like(), "pld"), (gpu_like(), "model")):
            smol.costs, smol_draft.costs = curves
            smol.reset()
            smol_draft.reset()
            drafter = ModelDrafter(smol_draft, smol.n_vocab, smol.eog_mask, k_max=8, p_min=0.0,
                                   target_costs=smol.costs)
            draft = drafter.propose(ids, 8)
            if expect == "model":           # the request's first round: no draft prefill before its first token
                assert draft.source == "pld" and smol_draft.n_past == 0
                draft = drafter.propose(ids, 8)
            assert draft.source == expect
            if expect == "model":
                assert len(draft.tokens) >= 5 and len(draft.levels) == len(draft.tokens)
            else:
                assert smol_draft.n_past == 0            # the draft model did no work at all
    finally:
        smol.costs, smol_draft.costs = saved


def test_corpus_lookup_finds_the_longest_match_and_prefers_the_context_on_ties():
    corpus = Corpus(np.array([7, 1, 2, 3, 4, 9, 9, 1, 2, 3, 5], dtype=np.int32))
    assert corpus.find(np.array([2, 3], dtype=np.int32), 4) == (9, 2)     # the most recent "2 3"
    assert corpus.find(np.array([7, 1, 2, 3], dtype=np.int32), 4) == (3, 4)
    assert corpus.find(np.array([8], dtype=np.int32), 4) == (-1, 0)
    eog = np.zeros(16, dtype=bool)
    lookup = PromptLookup(eog, max_ngram=4, corpus=corpus)
    context = np.array([6, 7, 1, 2, 3], dtype=np.int32)   # in the context only "3" recurs (nowhere): corpus wins
    assert list(lookup.propose(context, 3).tokens) == [4, 9, 9]
    context = np.array([2, 3, 8, 2, 3], dtype=np.int32)   # "2 3" in both: the context's continuation
    assert find_match(context, 4) == (1, 2)
    assert list(lookup.propose(context, 2).tokens) == [8, 2]
    corpus.add(np.array([6, 6, 2, 3, 11], dtype=np.int32))   # generated text is searched next time
    assert list(PromptLookup(eog, corpus=corpus).propose(np.array([0, 2, 3], dtype=np.int32), 1).tokens) == [11]


def test_the_cost_cache_lives_where_it_is_told(costs):
    assert costs_dir() == costs


def test_a_pinned_curve_answers_from_its_calibration_and_ignores_timings():
    """What a seeded run with a loose verifier decides on: the calibrated values, whatever the
    rounds measured, before or during the run; the refined values come back when unpinned."""
    curve = CostCurve(key={"model": "pinned-test"})
    curve.calibrate(lambda rows: 0.01 + 0.001 * rows, max_rows=9)
    curve.pin(True)
    calibrated = curve.cost(9).copy()
    curve.pin(False)
    for _ in range(30):                              # a loaded machine, 9-row rounds dearer too
        curve.update(1, 0.05)
        curve.update(9, 0.05 * 2.5)
    refined = curve.cost(9).copy()
    assert refined[0] > 4 * calibrated[0] and curve.shape(9) == pytest.approx(2.5)
    curve.pin(True)
    assert curve.cost(9).tolist() == calibrated.tolist()
    assert curve.explore(np.array([1.0, 0.5, 0.2]), 0) == 0       # never tries another length
    curve.update(9, 5.0)
    assert curve.cost(9).tolist() == calibrated.tolist()
    curve.pin(False)
    assert curve.cost(9).tolist() == refined.tolist()
    curve.save()
    again = CostCurve(key={"model": "pinned-test"})
    assert again.load()
    again.pin(True)
    assert again.cost(9).tolist() == calibrated.tolist()      # the calibration survives the cache


def test_a_larger_size_extends_the_calibration_without_changing_it():
    """A run that needs a larger size than the cache holds measures it, and what was calibrated
    stays as it was (a seeded run decides on it); a round past the largest size keeps the curve."""
    curve = CostCurve(key={"model": "extend-test"})
    curve.ensure(lambda rows: 0.01 + 0.001 * rows, max_rows=9)
    before = curve.base[:9].copy()
    curve.ensure(lambda rows: 0.05 + 0.002 * rows, max_rows=33, limit=64)       # a slower machine now
    np.testing.assert_array_equal(curve.base[:9], before)          # NaN where a size was not measured
    assert curve.largest() >= 33
    curve.update(1, 0.011)
    curve.update(80, 0.2)
    assert curve.calibrated and curve.cost(80)[79] >= curve.cost(33)[32] > 0


def said_before_measuring(costs, case: str) -> tuple[list[str], Path]:
    """What a first request says, the cache holding `case` for KEY: its lines, and the path."""
    path = store.path_for(KEY)
    costs.mkdir(exist_ok=True)
    content = {"empty": "", "garbage": "\x00{not json", "absurd": json.dumps(
        {"format": 2, "key": KEY, "calibration": {"seconds": [1e300, 1.4e300, 1.8e300]}, "refined": []})}
    if case in content:
        path.write_text(content[case])
    said = []
    curve = CostCurve(key=KEY)
    curve.say = said.append
    curve.ensure(probe([]), max_rows=9)
    return said, path


@pytest.mark.parametrize("case", ["missing", "empty", "garbage", "absurd"])
def test_a_calibration_the_cache_cannot_spare_says_in_one_line_what_it_measures_and_why(costs, case):
    said, path = said_before_measuring(costs, case)
    why = {"missing": f"no curve of it is cached in {costs} yet",
           "empty": f"the cost cache at {path} is empty",
           "garbage": f"the cost cache at {path} is not JSON",
           "absurd": f"the cost cache at {path} holds an absurd curve: a single step of 1e+300 s"}[case]
    assert len(said) == 1 and said[0].startswith(f"measuring the decode cost of m on this machine ({why}")
    assert said[0].endswith(f"): up to {BUDGET:g} s")


def test_a_curve_read_from_the_cache_or_measured_again_later_says_nothing(costs, monkeypatch):
    """The usual case, a curve read from the cache, is silent as before; so are a larger size
    measured onto a cached curve, --recalibrate (asked for) and a provisional curve's retries."""
    said_before_measuring(costs, "missing")
    said = []
    for max_rows, recalibrate in ((9, False), (33, False), (9, True)):
        curve = CostCurve(key=KEY)
        curve.say = said.append
        curve.ensure(probe([]), max_rows=max_rows, limit=64, recalibrate=recalibrate)
    stalls = [0]

    def never_agreeing(rows):
        stalls[0] += 1
        return 0.01 * (1 + 0.4 * (rows - 1)) * 1.5 ** stalls[0]

    other = CostCurve(key={**KEY, "threads": 1})
    other.ensure(never_agreeing, max_rows=9)
    assert other.state == "provisional"
    other.say = said.append
    monkeypatch.setattr(curve_module.time, "monotonic", lambda: 1e12)
    other.ensure(never_agreeing, max_rows=9)
    assert said == []


@pytest.mark.slow
def test_generate_says_why_it_measures_over_an_unreadable_cache_and_nothing_over_a_sound_one(tmp_path, smol):
    """The command line, on the default target: a cache file that is not JSON is measured over,
    after one line on stderr naming the model, the file and why; a sound file is read in
    silence."""
    env = {**os.environ, "FLYLOCAL_COSTS": str(tmp_path / "costs")}
    key = smol.costs.key                      # the command's own curve: same file, build, threads, batch
    path = tmp_path / "costs" / store.path_for(key).name
    path.parent.mkdir()
    path.write_bytes(b"\x00\x01garbage")

    def generate():
        return subprocess.run([sys.executable, "-m", "flylocal", "generate", "Name three colours.", "--max-tokens",
                               "4", "--json", "--drafter", "pld"], capture_output=True, text=True, env=env, timeout=300)

    done = generate()
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "measuring" in line]
    assert lines == ["flylocal: measuring the decode cost of smollm2-135m-instruct on this machine (the cost cache at "
                     f"{path} is not JSON): in slices, never more than {WAIT:g} s before a first token"], done.stderr
    assert json.loads(done.stdout)["stats"]["cost_curve"]["source"] == "prior"
    # Measured after the answer: settled over the garbage on a quiet machine; on a busy one,
    # provisional in a file of its own, or nothing where the load distorted it. Never is the
    # garbage read as a curve, nor is a file left half written.
    record, problem = store.read_file(path)
    assert record is not None or problem == "is not JSON"
    provisional = store.path_for(key, provisional=True).name
    if (path.parent / provisional).exists():
        assert store.read_file(path.parent / provisional)[0] is not None
    path.write_text(json.dumps({"format": 2, "key": key, "refined": [],
                                "calibration": {"seconds": [0.009 * (1 + 0.4 * n) for n in range(17)]}}))
    done = generate()
    assert done.returncode == 0, done.stderr
    assert "measuring" not in done.stderr, done.stderr
    assert json.loads(done.stdout)["stats"]["cost_curve"]["source"] == "cache"


def test_a_saved_size_cheaper_than_a_smaller_one_is_dropped(costs):
    """The default target's cache held 8 rows at 2.9 single steps beside 4 rows at 3.2 (a shared
    decode's time, refined against single steps that carried the graph's rebuild), and drafts in
    company went in at a quarter of their cost. More rows never cost less: 8 rows' value is
    dropped as distorted, the calibration stands there, and the other refined sizes stay."""
    base = [0.00743, 0.01437, 0.01771, None, 0.02665, None, None, None, 0.03983]
    refined = [None, 1.804, 2.246, 3.167, None, None, None, 2.884, None]
    costs.mkdir(exist_ok=True)
    path = store.path_for(KEY)
    path.write_text(json.dumps({"format": 2, "key": KEY, "calibration": {"seconds": base}, "refined": refined}))
    curve = CostCurve(key=KEY)
    assert curve.load() and curve.state == "repaired" and "8: 2.9" in curve.problem
    assert curve.calibrated_shape(8)[7] > 4.5 and curve.calibrated_shape(4)[3] == pytest.approx(3.167)
    assert np.isnan(store.read_record(json.loads(path.read_text()))["refined"][7])
