"""Speculation that survives a busy machine (docs/design.md, "Cost model"): cost curves that
load cannot poison, a controller that finds its way back, on a simulated machine.

`Machine` (tests/fake_backend.py) is the clock of the engine and of the fake target: a decode
of n tokens takes step * (1 + 0.4 (n - 1)) seconds, some of them stalled 100x. The drafter is
an oracle that proposes the target's greedy continuation (a copy in progress: every draft
token is accepted when verified), so the best draft length is the longest, and a round that
does not draft is the controller's own doing.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fake_backend import FakeLM, FakeTarget, Machine, NoisyOracle, QuietLoad, controlled
from flylocal import host
from flylocal.decoding.costs import curve as costs_module
from flylocal.decoding.costs import store
from flylocal.decoding.adaptive import DraftLength, ModelDraftLength, timed_decode
from flylocal.decoding.costs import BUDGET, EXPLORE, CostCurve, read_record
from flylocal.decoding.costs.shape import SWITCH_MAX
from flylocal.decoding.engine import Engine, EngineConfig, generate_all
from flylocal.decoding.verifiers.strict import Strict

LM = FakeLM(seed=7, n_vocab=48, eog=(), p_eog=0.0)
KEY = {"model": "/sim.gguf", "threads": 2}
TRUE_SHAPE = 1 + 0.4 * np.arange(17)          # the machine's t(n)/t(1), n = 1..17


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLYLOCAL_COSTS", str(tmp_path / "costs"))
    monkeypatch.setattr(host, "CpuLoad", QuietLoad)
    return tmp_path / "costs"


class NeverAgreeing:
    """A probe whose every size is slower each time it is measured: the passes never agree."""

    def __init__(self):
        self.seen: list[int] = []

    @property
    def calls(self) -> int:
        return len(self.seen)

    def __call__(self, rows: int) -> float:
        self.seen.append(rows)
        return 0.01 * (1 + 0.4 * (rows - 1)) * 1.5 ** self.seen.count(rows)


def engine_on(machine: Machine, curve: CostCurve, p_corrupt: float = 0.0, seed: int = 0, k: int = 8,
              max_tokens: int = 300, n_ctx: int = 4096):
    target = FakeTarget(LM, n_ctx=n_ctx, costs=curve, machine=machine)
    drafter = controlled(NoisyOracle(LM, seed=seed, p_corrupt=p_corrupt, p_eog=0.0, p_short=0.0), k, target)
    return target, Engine(target, drafter, Strict(), EngineConfig(max_tokens=max_tokens, k=k, trace=True), clock=machine)


def prompt(seed: int, n: int = 12) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, LM.n_vocab, size=n).astype(np.int32)


def drafted_rounds(traces) -> list[int]:
    return [len(t["draft"]) for t in traces]


def test_a_curve_poisoned_like_the_busy_hours_cache_drafts_again_within_a_few_rounds(cache):
    """The cache file a busy hour left: calibrated values right, refined ones 100x too dear at
    2-9 rows. Loaded, the refinement is dropped as distorted (and the file repaired), so a copy
    drafts from the first rounds."""
    single = 0.0084
    base = [single, 0.0143, 0.0204, None, 0.0285, None, None, None, 0.046] + [None] * 7 + [0.0772]
    refined = [0.0114, 1.620, 1.724, None, 1.622, None, None, None, 1.656] + [None] * 7 + [0.0772]
    curve = CostCurve(key=KEY)
    cache.mkdir()
    path = store.path_for(KEY)
    path.write_text(json.dumps({"format": 1, "key": KEY, "seconds": refined, "base": base}))
    assert curve.load() and curve.state == "repaired" and "distorted" in curve.problem
    assert curve.shape(9) == pytest.approx(0.046 / single)          # the calibration stands
    on_disk = read_record(json.loads(path.read_text()))
    assert on_disk["format"] == 2 and on_disk["problem"] is None    # repaired, not obeyed
    assert np.isnan(on_disk["refined"][1:9]).all()
    machine = Machine(step=single)
    _, engine = engine_on(machine, curve, max_tokens=160)
    _, stats, traces = generate_all(engine, prompt(1))
    drafts = drafted_rounds(traces)
    assert np.mean([d > 0 for d in drafts[1:]]) > 0.9 and np.mean(drafts) >= 4, drafts
    assert stats.cost_curve["state"] == "repaired"
    fresh = Machine(step=single)
    _, engine = engine_on(fresh, CostCurve(seconds=single * TRUE_SHAPE), max_tokens=160)
    _, fresh_stats, _ = generate_all(engine, prompt(1))
    assert stats.emitted / machine.decode_s >= 0.9 * fresh_stats.emitted / fresh.decode_s


def test_a_cache_whose_calibration_breaks_physics_is_measured_again(cache):
    """The exact build's poisoned calibration: one row 159 ms, more rows ~ 20 ms. Not obeyed:
    measured again when first needed, and the file replaced."""
    curve = CostCurve(key=KEY)
    cache.mkdir()
    store.path_for(KEY).write_text(json.dumps({"format": 1, "key": KEY, "base": [0.159, 0.021, 0.026],
                                         "seconds": [0.159, 0.021, 0.026]}))
    assert not curve.load() and curve.state == "repaired"
    machine = Machine(step=0.017)
    target = FakeTarget(LM, n_ctx=256, costs=curve, machine=machine)
    target.decode(prompt(2))
    curve.ensure(lambda rows: timed_decode(target, 3, rows, machine), max_rows=9)
    assert curve.source == "measured" and curve.state == "repaired"
    assert curve.calibrated_step() == pytest.approx(0.017)
    assert curve.shape(9) == pytest.approx(TRUE_SHAPE[8])
    again = CostCurve(key=KEY)
    assert again.load() and again.state == "settled" and again.calibrated_step() == pytest.approx(0.017)


@pytest.mark.parametrize("seed", range(6))
def test_a_calibration_wrong_within_physics_corrects_itself_within_a_generation(seed):
    """A curve no file check can catch: every size about 2.7x too dear in single steps (a
    decode of 9 rows 11 steps, where it takes 4.2), so the controller starts on plain steps.
    Exploring the cheapest sizes first, within its budget, it finds the shape and drafts long
    again within the first 150 of 300 tokens."""
    wrong = 1 + 1.25 * np.arange(17)
    curve = CostCurve(seconds=0.01 * wrong)
    machine = Machine(step=0.01, noise=0.03, seed=seed)
    _, engine = engine_on(machine, curve, seed=seed, max_tokens=300)
    _, stats, traces = generate_all(engine, prompt(seed))
    drafts = drafted_rounds(traces)
    assert drafts[0] == 0                                   # the wrong curve did switch drafting off
    start = next(i for i, d in enumerate(drafts) if d >= 6)
    assert sum(len(t["emitted"]) for t in traces[:start]) < 150, drafts
    assert np.mean([d >= 4 for d in drafts[start:]]) > 0.9, drafts
    assert curve.shape(9) == pytest.approx(TRUE_SHAPE[8], rel=0.1)


def test_a_load_that_passes_leaves_no_trace_in_the_decisions():
    """A spell 10x slower everywhere (a busy machine), then idle again: the curve's speed
    follows, its shape does not move, and every draft-length decision made on it after the
    spell is the one made on the curve of a run that never saw it."""
    def run(spell: bool) -> CostCurve:
        curve = CostCurve(seconds=0.01 * TRUE_SHAPE)
        machine = Machine(step=0.01, seed=3)
        target, engine = engine_on(machine, curve, p_corrupt=0.25, seed=3, max_tokens=120)
        for turn in range(3):
            machine.slow = 10.0 if spell and turn == 1 else 1.0
            target.reset()
            generate_all(engine, prompt(10 + turn))
        return curve

    calm, busy = run(False), run(True)
    assert np.allclose(busy.shape_of(9), calm.shape_of(9), rtol=0.05)
    assert busy.speed() == pytest.approx(0.01, rel=0.05)
    prior = NoisyOracle(LM).level_prior
    for level in range(len(prior)):
        for available in range(1, 9):
            assert (DraftLength(8, prior, busy).best(level, available)
                    == DraftLength(8, prior, calm).best(level, available))


@pytest.mark.parametrize("seed", range(4))
def test_stalls_of_100x_never_move_the_saved_shape(cache, seed):
    """One decode in ten stalls 100x, in calibration and in the rounds. What is saved (the
    calibrated shape and the refinement) is within a few percent of what the same machine
    saves without stalls. (The calibration is given the time such stalls take: within its
    usual budget it would be cut short and saved nowhere.)"""
    def saved(p_stall: float) -> np.ndarray:
        key = dict(KEY, stalls=p_stall, seed=seed)
        curve = CostCurve(key=key)
        curve.budget = 1000.0
        machine = Machine(step=0.01, noise=0.01, p_stall=p_stall, seed=seed)
        target, engine = engine_on(machine, curve, p_corrupt=0.2, seed=seed, max_tokens=250)
        for turn in range(2):
            target.reset()
            ids = prompt(20 + turn)
            target.decode(ids[:-1])
            curve.ensure(lambda rows: timed_decode(target, int(ids[-1]), rows, machine), max_rows=9)
            assert curve.state == "settled"
            target.reset()
            generate_all(engine, ids)
        curve.save()
        again = CostCurve(key=key)
        assert again.load()
        return again.shape_of(17)

    clean, stalled = saved(0.0), saved(0.1)
    assert np.allclose(stalled, clean, rtol=0.04), (stalled, clean)
    assert np.allclose(clean, TRUE_SHAPE, rtol=0.05)


@pytest.mark.parametrize("seed", range(4))
def test_exploration_stays_within_its_budget_on_an_honest_curve(seed, monkeypatch):
    """On a curve that is right, trying stale sizes costs at most EXPLORE of the decoding time:
    by the controller's own account, and measured as tokens per second against the same runs
    with exploration switched off."""
    def run(explore: bool):
        if not explore:
            monkeypatch.setattr(CostCurve, "explore", lambda self, rates, best: best)
        curve = CostCurve(seconds=0.01 * TRUE_SHAPE)
        machine = Machine(step=0.01, seed=seed)
        target, engine = engine_on(machine, curve, p_corrupt=0.3, seed=seed, max_tokens=400)
        emitted = 0
        for turn in range(4):
            target.reset()
            _, stats, _ = generate_all(engine, prompt(40 + turn))
            emitted += stats.emitted
        monkeypatch.undo()
        return curve, emitted / machine.decode_s

    curve, with_explore = run(True)
    _, without = run(False)
    assert curve.explored > 0
    assert curve.spent <= EXPLORE * curve.decoded_s + 0.01 * TRUE_SHAPE[8]     # one round's overshoot at most
    assert with_explore >= (1 - 2 * EXPLORE) * without, (with_explore, without)


def test_calibration_repeats_until_its_passes_agree_and_keeps_the_lowest():
    """Stalled probes are measured over; the lowest of agreeing samples counts."""
    calls = []
    stalls = {3: 2, 19: 1}                        # the 3rd and 19th probe (size 2 in passes 1, 2) take 100x

    def probe(rows):
        calls.append(rows)
        t = 0.01 * (1 + 0.4 * (rows - 1))
        return t * 100 if stalls.get(len(calls)) else t

    curve = CostCurve(key=None)
    curve.calibrate(probe, max_rows=9, meter=QuietLoad())
    assert curve.state == "settled" and curve.meta["passes"] == 4      # size 2 stalled twice in 3
    assert np.allclose(curve.shape_of(9), TRUE_SHAPE[:9])


def test_calibration_measures_what_changing_the_row_count_back_costs():
    """llama.cpp builds its graph again when the row count changes: the single step after a
    draft's round costs more than a steady one, and a round's cost counts it to the draft."""
    last = [1]

    def probe(rows):
        t = 0.01 * (1 + 0.4 * (rows - 1)) + (0.001 if rows != last[0] else 0.0)
        last[0] = rows
        return t

    curve = CostCurve(key=None)
    curve.calibrate(probe, max_rows=9, meter=QuietLoad())
    assert curve.state == "settled"
    assert curve.calibrated_step() == pytest.approx(0.01)                 # a steady single step
    assert curve.switch() == pytest.approx(0.1)                           # 1 ms of a 10 ms step
    cost = curve.cost(3)
    assert cost[0] == pytest.approx(0.01)
    assert cost[1:] == pytest.approx([0.014 + 0.001 + 0.001, 0.018 + 0.001 + 0.001])


def test_a_draft_that_only_pays_without_the_switch_back_is_not_made():
    """Two rows cost 1.75 single steps (changing to them included) and 0.1 more to change
    back: a one-token draft accepted 85% of the time (1.85 tokens a round) pays against 1.75
    steps and loses against 1.85."""
    seconds = 0.01 * np.array([1.0, 1.75])                # t(2) as measured after a single step
    with_switch = CostCurve(seconds=seconds)
    with_switch.meta["switch"] = 0.001
    with_switch.source = "cache"
    without = CostCurve(seconds=seconds)
    prior = np.array([0.85])
    assert DraftLength(1, prior, curve=without).best(0, 1) == 1
    assert DraftLength(1, prior, curve=with_switch).best(0, 1) == 0


def test_a_calibration_that_never_settles_is_cached_provisional_and_a_quiet_one_replaces_it(cache, monkeypatch):
    noisy = NeverAgreeing()
    curve = CostCurve(key=KEY)
    curve.ensure(noisy, max_rows=9)
    assert curve.state == "provisional" and "disagree" in curve.problem and curve.calibrated
    record, _ = store.read(KEY)                                            # cached, marked provisional
    assert record is not None and "disagree" in record["meta"]["provisional"]
    # The next process starts from it and measures again; on a quiet machine that settles.
    later = CostCurve(key=KEY)
    calls = []
    steady = lambda rows: calls.append(rows) or 0.01 * (1 + 0.4 * (rows - 1))   # noqa: E731
    later.ensure(steady, max_rows=9)
    assert calls and later.state == "settled" and "provisional" not in store.read(KEY)[0]["meta"]
    # A provisional curve never overwrites a settled one.
    curve.save_provisional()
    assert "provisional" not in store.read(KEY)[0]["meta"]
    monkeypatch.setattr(costs_module.time, "monotonic", lambda: 1e12)     # RETRY seconds later
    curve.ensure(noisy, max_rows=9)
    assert curve.state == "settled" and len(list(cache.glob("*.json"))) == 1


class Steady:
    """The machine at rest: a decode of n rows takes 10 ms x TRUE_SHAPE[n], on a clock of its own
    (`now`) that only decodes move."""

    def __init__(self):
        self.t = 0.0

    def __call__(self, rows: int) -> float:
        took = 0.01 * TRUE_SHAPE[rows - 1]
        self.t += took
        return took

    def now(self) -> float:
        return self.t


def test_a_request_waits_a_slice_of_the_calibration_and_the_rest_follows_in_slices(cache):
    """With `wait`, the first call measures nothing (the prior's shape until the rounds and the
    slices measure it), and no later call measures for much more than `wait` (the two sizes a
    curve needs aside): the curve is provisional from its first slice, used meanwhile, and
    settles and is saved once the slices add up to a whole calibration, as one measured at once
    would."""
    steady = Steady()
    clock = steady.now
    curve = CostCurve(key=KEY)
    curve.clock = clock
    curve.ensure(steady, max_rows=9, wait=0.05)
    assert clock() == 0 and curve.source == "prior" and curve.state == "provisional"
    assert not curve.calibrated and "nothing measured yet: the prior's shape" in curve.problem
    assert np.allclose(curve.shape_of(9), 1 + 0.4 * np.arange(9))
    slices = []
    while curve.state != "settled" and len(slices) < 200:
        before = clock()
        curve.ensure(steady, max_rows=9, wait=0.05)
        slices.append(clock() - before)
        assert curve.calibrated, "usable from the first slice"
        if curve.state != "settled":
            assert curve.state == "provisional" and "being measured" in curve.problem
    assert curve.state == "settled" and len(slices) > 3 and store.read(KEY)[0] is not None
    # within the wait, or one decode that alone takes longer: none starts that is expected to overrun
    assert max(slices[1:]) <= max(0.05, 0.01 * TRUE_SHAPE[16]) + 1e-9
    assert np.allclose(curve.shape_of(9), TRUE_SHAPE[:9])
    whole = CostCurve(key={**KEY, "threads": 99})
    whole.ensure(steady, max_rows=9)
    assert np.allclose(whole.base[:9], curve.base[:9], equal_nan=True)


def test_a_request_says_whether_its_curves_were_still_being_measured_when_it_ended(cache):
    """A server's requests report `calibrating` while the curve is still being measured (the
    next request waits a slice: what a benchmark warms up through), and not once it has settled
    and is cached; a process that reads the cached curve never does."""
    machine = Machine(step=0.01, row_cost=0.4)
    curve = CostCurve(key=KEY)
    curve.clock = machine
    target = FakeTarget(LM, n_ctx=4096, costs=curve, machine=machine)
    drafter = controlled(NoisyOracle(LM, seed=0, p_corrupt=0.1, p_eog=0.0, p_short=0.0), 8, target)
    engine = Engine(target, drafter, Strict(), EngineConfig(max_tokens=8, k=8, calibration_wait=0.05), clock=machine)
    said = []
    while len(said) < 100 and (not said or said[-1]):
        target.reset()
        _, stats, _ = generate_all(engine, prompt(len(said)))
        said.append(stats.calibrating)
        assert stats.to_dict().get("calibrating", False) == stats.calibrating
    assert said[0] and not said[-1] and len(said) > 3, said
    assert curve.state == "settled" and store.read(KEY)[0] is not None
    fresh = CostCurve(key=KEY)
    fresh.clock = machine
    target = FakeTarget(LM, n_ctx=4096, costs=fresh, machine=machine)
    drafter = controlled(NoisyOracle(LM, seed=0, p_corrupt=0.1, p_eog=0.0, p_short=0.0), 8, target)
    engine = Engine(target, drafter, Strict(), EngineConfig(max_tokens=8, k=8, calibration_wait=0.05), clock=machine)
    assert not generate_all(engine, prompt(1))[1].calibrating
    assert "calibrating" not in generate_all(engine, prompt(2))[1].to_dict()


def test_a_provisional_curve_is_measured_again_at_most_retries_times(cache, monkeypatch):
    """Each retry keeps a request waiting for a calibration: under endless load they stop."""
    noisy = NeverAgreeing()
    now = [0.0]
    monkeypatch.setattr(costs_module.time, "monotonic", lambda: now[0])
    curve = CostCurve(key=KEY)
    curve.ensure(noisy, max_rows=9)
    calibrations = [noisy.calls]
    for _ in range(costs_module.RETRIES + 3):
        now[0] += 1e6                                                    # long past every wait
        curve.ensure(noisy, max_rows=9)
        calibrations.append(noisy.calls)
    grew = sum(b > a for a, b in zip(calibrations, calibrations[1:]))
    assert curve.state == "provisional" and grew == costs_module.RETRIES, calibrations


def test_a_provisional_curve_takes_the_one_another_process_cached(cache, monkeypatch):
    """A second server on the same model settled the curve meanwhile: read, not measured."""
    noisy = NeverAgreeing()
    curve = CostCurve(key=KEY)
    curve.ensure(noisy, max_rows=9)
    assert curve.state == "provisional"
    other = CostCurve(key=KEY)
    other.ensure(lambda rows: 0.01 * (1 + 0.4 * (rows - 1)), max_rows=9)
    assert other.state == "settled" and list(cache.glob("*.json"))
    monkeypatch.setattr(costs_module.time, "monotonic", lambda: 1e12)

    def never(rows):
        raise AssertionError("measured again although a settled curve was cached")

    curve.ensure(never, max_rows=9)
    assert curve.state == "settled" and curve.source == "cache"
    assert np.allclose(curve.shape_of(9), TRUE_SHAPE[:9])


def test_a_calibration_while_other_work_keeps_the_cores_busy_is_provisional(cache):
    class Busy(QuietLoad):
        def stop(self):
            return 1.6

    curve = CostCurve(key=KEY)
    curve.calibrate(lambda rows: 0.01 * (1 + 0.4 * (rows - 1)), max_rows=9, meter=Busy())
    assert curve.state == "provisional" and "busy" in curve.problem
    curve.save()
    assert not list(cache.glob("*.json"))


def test_refinement_samples_that_break_physics_are_dropped_as_stalls():
    curve = CostCurve(seconds=0.01 * TRUE_SHAPE)
    for _ in range(5):
        for _ in range(3):
            curve.update(1, 0.01)
        curve.update(5, 0.01 * 100)               # 100 single steps for 5 rows: a stall
    assert curve.rejected == 5 and curve.shape(5) == pytest.approx(TRUE_SHAPE[4])
    assert curve.speed() == pytest.approx(0.01)   # a median: the stalls did not move it


def test_the_draft_models_cost_measured_under_load_expires():
    """Drafts measured while the machine was 10x slower, relative to the target's speed then,
    give the draft's cost now; once those drafts are STALE seconds old the calibrations' ratio
    answers again, so a draft model judged too dear is weighed afresh."""
    target = CostCurve(seconds=0.01 * TRUE_SHAPE)
    draft = CostCurve(seconds=0.002 * TRUE_SHAPE)
    plan = ModelDraftLength(8, target, draft)
    assert plan.step_s() == pytest.approx(0.002)
    for _ in range(5):
        target.update(1, 0.1)                      # the target is 10x slower now
    for _ in range(3):
        plan.observe([4] * 4, 4, 4 * 0.02 * 3)     # and the draft seemed 3x dearer still
    assert plan.step_s() == pytest.approx(0.06)
    for _ in range(10):
        target.update(1, 0.01)                     # idle again: the ratio holds, the speed follows
    assert plan.step_s() == pytest.approx(0.006)
    while target.decoded_s < costs_module.STALE + 1.0:
        target.update(1, 0.01)
    assert plan.step_s() == pytest.approx(0.002)


def refine(curve: CostCurve, nine: float = 3.0, times: int = 9) -> None:
    for _ in range(times):
        curve.update(1, 0.01)
        curve.update(9, 0.01 * nine)


def test_a_refinement_measured_while_other_work_was_busy_is_used_but_not_saved(cache, monkeypatch):
    class Busy(QuietLoad):
        def stop(self):
            return 1.2

    curve = CostCurve(key=KEY)
    curve.calibrate(lambda rows: 0.01 * (1 + 0.4 * (rows - 1)), max_rows=9)
    curve.save()
    monkeypatch.setattr(host, "CpuLoad", Busy)
    refine(curve)
    assert curve.shape(9) == pytest.approx(3.0)            # this process decides on it
    curve.save()
    again = CostCurve(key=KEY)
    assert again.load() and again.shape(9) == pytest.approx(TRUE_SHAPE[8])
    monkeypatch.setattr(host, "CpuLoad", QuietLoad)
    refine(again)
    again.save()
    third = CostCurve(key=KEY)
    assert third.load() and third.shape(9) == pytest.approx(3.0)   # a quiet period's is saved


def test_rounds_on_another_thread_count_than_the_curves_refine_it_unsaved(cache):
    curve = CostCurve(key=KEY)
    curve.calibrate(lambda rows: 0.01 * (1 + 0.4 * (rows - 1)), max_rows=9)
    curve.on_key = False                                   # --threads auto moved off every core
    refine(curve)
    assert curve.shape(9) == pytest.approx(3.0)
    curve.save()
    again = CostCurve(key=KEY)
    assert again.load() and again.shape(9) == pytest.approx(TRUE_SHAPE[8])


# What a cost cache file can hold that is no curve of the model: the file's bytes, given its
# key, and the words a line to the user says of it. Each one is measured over.
def cost_file(key: dict, seconds, **calibration) -> bytes:
    return json.dumps({"format": 2, "key": key, "calibration": {"seconds": list(seconds), **calibration},
                       "refined": []}).encode()


UNUSABLE = {
    "empty": (lambda key: b"", "is empty"),
    "truncated": (lambda key: cost_file(key, 0.01 * TRUE_SHAPE)[:60], "is not JSON"),
    "garbage": (lambda key: np.random.default_rng(0).bytes(3000), "is not JSON"),
    "nested past the parser": (lambda key: b"[" * 100_000, "is not JSON"),
    "not a curve": (lambda key: b'{"hello": 1}', "is not a cost curve"),
    "another key's": (lambda key: cost_file({"model": "/other.gguf"}, 0.01 * TRUE_SHAPE), "holds another curve"),
    "negative": (lambda key: cost_file(key, [-0.01, 0.014, 0.018]), "not positive"),
    "NaN single step": (lambda key: cost_file(key, [math.nan, 0.014, 0.018]), "absurd curve"),
    "huge": (lambda key: cost_file(key, [1e300, 1.4e300, 1.8e300]), "absurd curve"),
    "tiny": (lambda key: cost_file(key, [1e-300, 1.4e-300, 1.8e-300]), "absurd curve"),
    "an integer past floats": (lambda key: cost_file(key, [0.01, 0.014]).replace(b"0.014", b"1" + b"0" * 400),
                               "not positive and finite"),
    "thousands of sizes": (lambda key: cost_file(key, 0.02 * (1 + 0.4 * np.arange(5000))), "5000 sizes"),
    "numbers as strings": (lambda key: cost_file(key, [str(0.02 * s) for s in TRUE_SHAPE]), "not numbers"),
    "breaks physics": (lambda key: cost_file(key, [0.159, 0.021, 0.026]), "absurd curve"),
}


def stalling_machine() -> Machine:
    """Busy loops beside the model: 3 decodes in 10 stall 100x. On 2 cores beside busy loops and
    another llama.cpp process, today's calibration took 144 s over 8 passes."""
    return Machine(step=0.01, p_stall=0.3, seed=1)


@pytest.mark.parametrize("case", ["missing", *UNUSABLE])
def test_a_calibration_on_a_stalling_machine_ends_within_its_budget_whatever_the_cache_held(cache, case):
    """Whatever the cache file holds, the calibration that replaces it decodes for at most
    BUDGET seconds, give or take the one decode that crossed it, and the curve is what it
    measured: used, provisional, not saved. One line said why it measured, before it did."""
    cache.mkdir()
    if case != "missing":
        store.path_for(KEY).write_bytes(UNUSABLE[case][0](KEY))
    curve = CostCurve(key=KEY)
    said = []
    curve.say = said.append
    machine = stalling_machine()
    target = FakeTarget(LM, n_ctx=256, costs=curve, machine=machine)
    target.decode(prompt(2))
    start = machine()
    curve.ensure(lambda rows: timed_decode(target, 3, rows, machine), max_rows=9)
    longest = machine.stall * machine.step * machine.shape(17)
    assert machine() - start <= BUDGET + longest
    assert curve.source == "measured" and curve.calibrated and curve.state == "provisional"
    assert not CostCurve(key=KEY).load()                 # nothing measured in such a spell is saved
    why = "no curve of it is cached" if case == "missing" else UNUSABLE[case][1]
    assert len(said) == 1 and why in said[0], said


def test_a_calibration_out_of_time_keeps_what_it_measured_and_goes_no_further(cache):
    """A machine 50x slower than usual everywhere: its passes agree, but three of them would
    take a minute. The calibration stops once BUDGET seconds of decodes are spent, keeps the
    sizes it reached at what they cost (a coarser curve, the rest along the last slope), and
    the request after it measures nothing."""
    machine = Machine(step=0.01)
    machine.slow = 50.0
    curve = CostCurve(key=KEY)
    target = FakeTarget(LM, n_ctx=256, costs=curve, machine=machine)
    target.decode(prompt(3))
    sizes = []

    def probe(rows):
        sizes.append(rows)
        return timed_decode(target, 3, rows, machine)

    start = machine()
    curve.ensure(probe, max_rows=9)
    assert machine() - start <= BUDGET + 50 * 0.01 * machine.shape(17)
    assert curve.source == "measured" and curve.state == "provisional" and "out of time" in curve.problem
    assert 2 <= curve.largest() < 17
    seen = np.flatnonzero(~np.isnan(curve.base)) + 1
    assert np.allclose(curve.base[seen - 1], 0.5 * TRUE_SHAPE[seen - 1])      # what it measured stands
    n = len(sizes)
    curve.ensure(probe, max_rows=9)
    assert len(sizes) == n


@pytest.mark.parametrize("case", ["huge", "tiny", "an integer past floats", "thousands of sizes", "numbers as strings",
                                  "negative", "NaN single step", "breaks physics"])
def test_absurd_times_in_a_cache_file_are_never_used_as_costs(cache, case):
    """A file whose times no decode can take (or more sizes than any curve has) is not read as a
    curve: the model is measured again on its first request and the file replaced."""
    cache.mkdir()
    path = store.path_for(KEY)
    path.write_bytes(UNUSABLE[case][0](KEY))
    curve = CostCurve(key=KEY)
    machine = Machine(step=0.01)
    target = FakeTarget(LM, n_ctx=256, costs=curve, machine=machine)
    target.decode(prompt(2))
    curve.ensure(lambda rows: timed_decode(target, 3, rows, machine), max_rows=9)
    assert curve.source == "measured" and curve.state in ("settled", "repaired")
    assert curve.calibrated_step() == pytest.approx(0.01) and curve.largest() == 17
    assert np.allclose(curve.calibrated_shape(17), TRUE_SHAPE)
    assert 0 <= curve.switch() <= SWITCH_MAX
    on_disk = read_record(json.loads(path.read_text()))
    assert on_disk is not None and on_disk["base"][0] == pytest.approx(0.01) and len(on_disk["base"]) == 17


def test_absurd_fields_beside_a_sound_calibration_are_dropped_and_the_file_repaired(cache):
    """A sound calibration with a row switch no decode can cost (1e308 s), and fields of the
    wrong type: the calibration is used, the switch falls back to the prior, the rest goes, and
    the file is rewritten without them."""
    cache.mkdir()
    path = store.path_for(KEY)
    path.write_bytes(cost_file(KEY, 0.01 * TRUE_SHAPE, switch=1e308, passes="many", spread=math.nan,
                               busy_cores=[1, 2], measured="2026-12-03T11:00:00"))
    curve = CostCurve(key=KEY)
    assert curve.load() and curve.state == "repaired" and "switch" in curve.problem
    assert curve.switch() == costs_module.SWITCH_PRIOR
    assert curve.cost(2)[1] == pytest.approx(0.01 * (TRUE_SHAPE[1] + costs_module.SWITCH_PRIOR))
    assert curve.meta == {"measured": "2026-12-03T11:00:00"}
    on_disk = json.loads(path.read_text())["calibration"]
    assert "switch" not in on_disk and "passes" not in on_disk and "busy_cores" not in on_disk
    again = CostCurve(key=KEY)
    assert again.load() and again.state == "settled"


def test_a_switch_measured_beyond_physics_is_not_believed():
    """A single step after a larger decode measured 2 single steps dearer than a steady one (a
    stall, seen beside busy loops): no decode of one row costs that, so the prior stands."""
    last = [1]

    def probe(rows):
        t = 0.01 * (1 + 0.4 * (rows - 1)) + (0.02 if rows == 1 and last[0] != 1 else 0.0)
        last[0] = rows
        return t

    curve = CostCurve(key=None)
    curve.calibrate(probe, max_rows=9, meter=QuietLoad())
    assert curve.switch() == costs_module.SWITCH_PRIOR


def test_a_curve_being_measured_starts_from_the_same_models_curve_at_another_thread_count(cache):
    """Before its slices reach a size, a curve takes the shape there from a settled curve of the
    same model cached at another thread count, in this machine's single step now."""
    other_shape = np.minimum(1 + 0.4 * np.arange(17), 2.0)     # flat past 4 rows: unlike any slope
    sibling = CostCurve(key={**KEY, "threads": 4})
    sibling.ensure(lambda rows: 0.02 * other_shape[rows - 1], max_rows=17)
    assert sibling.state == "settled"
    steady = Steady()
    clock = steady.now
    curve = CostCurve(key=KEY)
    curve.clock = clock
    curve.ensure(steady, max_rows=17, wait=0.0)            # the first request: nothing measured
    assert clock() == 0 and curve.source == "prior" and "4 threads" in curve.problem, curve.problem
    assert np.isclose(curve.calibrated_shape(17)[-1], 2.0)    # the sibling's curve as it is
    curve.ensure(steady, max_rows=17, wait=0.04)           # the next: a slice of a few decodes
    assert curve.state == "provisional" and "4 threads" in curve.problem, curve.problem
    assert np.isclose(curve.calibrated_step(), 0.01)          # this machine's own step
    assert np.isclose(curve.calibrated_shape(17)[-1], 2.0)    # the sibling's shape where not yet measured
    alone = CostCurve(key={**KEY, "model": "/other.gguf"})    # no sibling: the slope of what it measured
    alone.clock = clock
    alone.ensure(steady, max_rows=17, wait=0.0)
    assert "prior's shape" in alone.problem
    alone.ensure(steady, max_rows=17, wait=0.04)
    assert "threads" not in alone.problem and alone.calibrated_shape(17)[-1] > 5
