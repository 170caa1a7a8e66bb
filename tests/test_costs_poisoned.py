"""How a wrong cost curve outlived the process that met it, one test per path, each failing
before its mend (docs/design.md, "Cost model"), on the fake backend's clock (`Machine`):

- a slice of a calibration counted the prompt's prefill as its own, so a request whose prompt
  took longer than the slice measured nothing and decided on the curve a loaded spell cached;
- a provisional curve cached by one process could replace the settled one another process
  wrote between its read and its write;
- a cached curve the rounds contradicted beyond noise (a foreign machine's, one poisoned within
  physics, one calibrated under a load the meter missed) was corrected for the process alone,
  and the next process started from the same wrong file.
"""

from __future__ import annotations

import numpy as np
import pytest

from fake_backend import FakeTarget, Machine, NoisyOracle, QuietLoad, controlled
from flylocal import host
from flylocal.decoding.adaptive import timed_decode
from flylocal.decoding.costs import CostCurve, store
from flylocal.decoding.engine import Engine, EngineConfig, generate_all
from flylocal.decoding.verifiers.strict import Strict
from test_costs_under_load import KEY, LM, TRUE_SHAPE, Steady, cache, prompt  # noqa: F401  (cache: autouse)


class Busy(QuietLoad):
    """A load meter that says other work kept both cores busy."""

    def stop(self):
        return 2.0


def cache_curve(seconds, **meta) -> None:
    store.write(KEY, {"measured": "2026-12-01T00:00:00", "passes": 3, **meta}, np.asarray(seconds, dtype=float),
                np.full(len(seconds), np.nan))


def process(machine: Machine, wait: float | None = 0.1, max_tokens: int = 300, curve: CostCurve | None = None):
    """A fresh process on `machine`: a curve for KEY (read from the cache as it needs; or
    `curve`), the fake target and an engine that waits at most `wait` seconds of calibration
    per request."""
    curve = curve or CostCurve(key=KEY)
    curve.clock = machine
    target = FakeTarget(LM, n_ctx=4096, costs=curve, machine=machine)
    # a copy in progress as prompt lookup sees it: drafts mostly right, of the length found
    drafter = controlled(NoisyOracle(LM, seed=0, p_corrupt=0.1, p_eog=0.0, p_short=0.5), 8, target)
    config = EngineConfig(max_tokens=max_tokens, k=8, trace=True, calibration_wait=wait)
    return curve, target, Engine(target, drafter, Strict(), config, clock=machine)


def speed(machine: Machine, stats) -> float:
    return stats.emitted / machine.decode_s


def test_a_slice_starts_with_its_first_decode_not_with_the_prompts_prefill():
    """The probe prefills the request's prompt before the slice's first decode: half a second
    here. That is not the slice's, so a 0.1 s slice still measures the small sizes, and the
    curve a loaded spell cached (dear at 9 and 17 rows) is not what the request decides on."""
    loaded = 0.01 * TRUE_SHAPE * np.where(np.arange(17) >= 8, 1.8, 1.0)
    cache_curve(loaded, provisional="2.00 cores were busy with other work", busy_cores=2.0)
    steady, head = Steady(), [0.5]

    def probe(rows: int) -> float:
        steady.t += head.pop() if head else 0.0      # the prompt, before the first timed decode
        return steady(rows)

    curve = CostCurve(key=KEY)
    curve.clock = steady.now
    curve.ensure(probe, max_rows=17, wait=0.1)
    assert steady.now() - 0.5 <= 0.1 + 1e-9                  # the first token waited one slice
    assert curve.state == "provisional" and "being measured" in curve.problem, curve.problem
    assert np.allclose(curve.base[:3], 0.01 * TRUE_SHAPE[:3])
    assert curve.shape(9) == pytest.approx(TRUE_SHAPE[8])    # the slope of what it measured, not the load's


def test_a_provisional_curve_cached_while_another_process_settles_never_replaces_the_settled_one(monkeypatch):
    """Process A measured under load; process B settles quietly and writes its curve right
    after A looked for one and before A wrote its provisional curve. B's stands."""
    a = CostCurve(key=KEY)
    a.calibrate(lambda rows: 0.01 * TRUE_SHAPE[rows - 1] * (1.3 if rows > 1 else 1), max_rows=9, meter=Busy())
    assert a.state == "provisional"
    b = CostCurve(key=KEY)
    real = store.tempfile.mkstemp

    def racing(*args, **kwargs):
        monkeypatch.setattr(store.tempfile, "mkstemp", real)
        b.ensure(lambda rows: 0.01 * TRUE_SHAPE[rows - 1], max_rows=9)     # B, between A's read and write
        assert b.state == "settled"
        return real(*args, **kwargs)

    monkeypatch.setattr(store.tempfile, "mkstemp", racing)
    a.save_provisional()
    assert b.state == "settled"                              # the race did happen
    fresh = CostCurve(key=KEY)
    assert fresh.load() and fresh.state == "settled"
    assert np.allclose(fresh.shape_of(9), TRUE_SHAPE[:9])
    # A provisional curve written after B's is beside it, never over it, and read only alone.
    a.save_provisional()
    assert store.read(KEY)[0]["meta"].get("provisional") is None
    store.path_for(KEY).unlink()
    assert store.read(KEY)[0]["meta"]["provisional"]


CONTRADICTED = {
    # a GPU's flat curve in a cache copied from another machine
    "foreign": 0.01 * (1 + 0.02 * np.arange(17)),
    # every size of more rows twice as dear, within physics and the file checks: drafting off
    "poisoned": 0.01 * TRUE_SHAPE * np.where(np.arange(17) >= 1, 2.0, 1.0),
    # the right shape, calibrated twice as slow: under a load the meter missed
    "slow": 0.02 * TRUE_SHAPE,
}


@pytest.mark.parametrize("case", CONTRADICTED)
def test_a_cached_curve_the_rounds_contradict_is_measured_again_and_the_next_process_starts_right(case):
    """Whatever the file says, rounds that disagree with it beyond noise drop it within the
    generation: measured again (whole at `finish`, for a process that serves one request) and
    cached, so the next process reads the machine's curve and runs as fast as one that never
    saw the bad file."""
    cache_curve(CONTRADICTED[case])
    machine = Machine(step=0.01, noise=0.05, seed=1)
    curve, target, engine = process(machine, wait=None, max_tokens=300)
    record, _ = store.read(KEY)
    assert record["calibration_problem"] is None and record["problem"] is None   # the file passes its checks
    _, stats, traces = generate_all(engine, prompt(1))
    assert "contradicted by the rounds" in str(curve.problem) and curve.contradicted == 1, curve.report()
    assert stats.cost_curve["contradicted"] == 1
    curve.finish(lambda rows: timed_decode(target, 3, rows, machine))
    assert curve.state == "settled"
    after = CostCurve(key=KEY)
    assert after.load() and after.state == "settled"
    assert after.calibrated_step() == pytest.approx(0.01, rel=0.1)
    assert np.allclose(after.calibrated_shape(17), TRUE_SHAPE, rtol=0.1)
    # the next process against one on a healthy cache, on the same prompt and machine
    machine = Machine(step=0.01, noise=0.05, seed=2)
    curve, _, engine = process(machine, wait=None, max_tokens=300)
    _, next_stats, _ = generate_all(engine, prompt(2))
    assert curve.contradicted == 0
    healthy = Machine(step=0.01, noise=0.05, seed=2)
    _, _, engine = process(healthy, wait=None, max_tokens=300, curve=CostCurve(seconds=0.01 * TRUE_SHAPE))
    _, healthy_stats, _ = generate_all(engine, prompt(2))
    assert speed(machine, next_stats) >= 0.97 * speed(healthy, healthy_stats)


@pytest.mark.parametrize("seed", [0, 1, 15, 19])
def test_a_healthy_curve_is_never_contradicted_by_noise_or_a_load_that_comes_and_goes(seed):
    """The machine's own curve, rounds with 20% noise, one in ten stalled 10x, and spells
    3x, 1.3x and 2x slower everywhere, over six requests: nothing contradicts it. (Let a round
    be in two pairs, so that a stall spoils two, and seeds 15 and 19 are contradicted.)"""
    cache_curve(0.01 * TRUE_SHAPE, busy_cores=0.0)
    machine = Machine(step=0.01, noise=0.2, p_stall=0.1, stall=10.0, seed=seed)
    curve, target, engine = process(machine, wait=0.1, max_tokens=200)
    for turn, slow in enumerate([1.0, 3.0, 1.0, 1.3, 2.0, 1.0]):
        machine.slow = slow
        target.reset()
        generate_all(engine, prompt(20 + turn + seed))
    assert curve.contradicted == 0 and curve.state == "settled", curve.report()


def test_a_curve_learned_under_load_never_outlives_the_load(monkeypatch):
    """A process on a busy machine measures its curve there: cached provisional, marked with
    the load. The next process, idle, decides on its own first slice (not on the loaded
    values), measures again and caches a settled curve; the one after reads it and runs as
    fast as on a healthy cache; a later process under load leaves the file as it was."""
    monkeypatch.setattr(host, "CpuLoad", Busy)
    busy = Machine(step=0.01, p_stall=0.3, stall=3.0, seed=5)
    curve, target, engine = process(busy)
    generate_all(engine, prompt(3))
    curve.finish(lambda rows: timed_decode(target, 3, rows, busy))
    assert curve.state == "provisional" and "busy" in curve.problem, curve.problem
    assert not store.path_for(KEY).exists()
    assert store.read(KEY)[0]["meta"]["provisional"]                   # marked, in a file of its own

    monkeypatch.setattr(host, "CpuLoad", QuietLoad)
    idle = Machine(step=0.01, seed=6)
    curve, target, engine = process(idle)
    before = idle()
    generation = engine.generate(prompt(4))
    next(iter(generation))
    assert idle() - before <= 0.1 + 0.01 * TRUE_SHAPE[16] + 0.5        # one slice, then the prompt and a round
    assert "being measured" in curve.problem and np.allclose(curve.base[:2], 0.01 * TRUE_SHAPE[:2])
    for _ in generation:
        pass
    curve.finish(lambda rows: timed_decode(target, 3, rows, idle))
    assert curve.state == "settled" and not store.path_for(KEY, provisional=True).exists()

    idle = Machine(step=0.01, seed=7)
    curve, _, engine = process(idle)
    _, stats, _ = generate_all(engine, prompt(5))
    assert stats.cost_curve["source"] == "cache" and stats.cost_curve["state"] == "settled"
    healthy = Machine(step=0.01, seed=7)
    _, _, engine = process(healthy, curve=CostCurve(seconds=0.01 * TRUE_SHAPE))
    _, healthy_stats, _ = generate_all(engine, prompt(5))
    assert speed(idle, stats) >= 0.97 * speed(healthy, healthy_stats)

    saved = store.path_for(KEY).read_bytes()
    monkeypatch.setattr(host, "CpuLoad", Busy)
    busy = Machine(step=0.01, p_stall=0.3, stall=3.0, seed=8)
    curve, target, engine = process(busy)
    generate_all(engine, prompt(6))
    curve.finish(lambda rows: timed_decode(target, 3, rows, busy))
    curve.save()
    assert store.path_for(KEY).read_bytes() == saved


def test_a_slice_that_timed_more_rows_cheaper_never_makes_them_cost_less():
    """One pass times each size once: 3 rows came in under 2 here. The curve decided on until
    the passes agree never has more rows cost less."""
    times = dict(enumerate(0.01 * TRUE_SHAPE, start=1)) | {3: 0.013}
    clock = [0.0]

    def probe(rows: int) -> float:
        clock[0] += times[rows]
        return times[rows]

    curve = CostCurve(key=KEY)
    curve.clock = lambda: clock[0]
    curve.ensure(probe, max_rows=17, wait=0.1)            # nothing known: nothing measured yet
    curve.ensure(probe, max_rows=17, wait=0.1)            # a slice: 1, 2 and 3 rows once each
    assert "being measured" in curve.problem and curve.largest() == 3
    shape = curve.shape_of(17)
    assert np.all(np.diff(shape) >= 0), shape
