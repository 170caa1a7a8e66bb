"""Cost by context (flylocal/decoding/costs/context.py, docs/design.md "Cost model"): on a
simulated machine whose rows cost more after a long context, as a real one's do, the rounds
measure that share, the draft length follows the cost at the request's own context, and the
curve's shape, the short context's, is left as it was.

`Machine(attend=a)` (tests/fake_backend.py): a decode of n rows after c cells adds
a * c * sqrt(n - 1) single steps, the form measured on a CPU. The drafter is an oracle right 70%
of the time a token, so the best draft length depends on what rows cost."""

from __future__ import annotations

import numpy as np
import pytest

from fake_backend import FakeLM, FakeTarget, Machine, NoisyOracle, QuietLoad, controlled
from flylocal import host
from flylocal.decoding.costs import CostCurve
from flylocal.decoding.costs import context as by_context
from flylocal.decoding.engine import Engine, EngineConfig, generate_all
from flylocal.decoding.verifiers.strict import Strict

LM = FakeLM(seed=11, n_vocab=40, eog=(), p_eog=0.0)
SHORT = 1 + 0.1 * np.arange(17)       # the machine's t(n)/t(1) after a short context: a flat, GPU-like curve
ATTEND = 2.4e-4                       # after 5,000 cells n rows cost 1.2 sqrt(n - 1) steps more: no draft pays


@pytest.fixture(autouse=True)
def quiet(monkeypatch, tmp_path):
    monkeypatch.setenv("FLYLOCAL_COSTS", str(tmp_path / "costs"))
    monkeypatch.setattr(host, "CpuLoad", QuietLoad)


def run(cells: int, seed: int = 0, tokens: int = 400):
    """Generate `tokens` tokens after a prompt of `cells` tokens: (curve, machine, drafts per round,
    tokens per decoding second)."""
    curve = CostCurve(seconds=0.01 * SHORT)
    machine = Machine(step=0.01, row_cost=0.1, attend=ATTEND, seed=seed)
    target = FakeTarget(LM, n_ctx=cells + tokens + 64, costs=curve, machine=machine)
    drafter = controlled(NoisyOracle(LM, seed=seed, p_corrupt=0.3, p_eog=0.0, p_short=0.0), 8, target)
    engine = Engine(target, drafter, Strict(), EngineConfig(max_tokens=tokens, k=8, trace=True), clock=machine)
    prompt = np.random.default_rng(seed).integers(1, LM.n_vocab, size=cells).astype(np.int32)
    target.decode(prompt[:-1])              # the prompt's cells, before the clock that counts
    start = machine.decode_s
    _, stats, traces = generate_all(engine, prompt)
    return curve, machine, [len(t["draft"]) for t in traces], stats.emitted / (machine.decode_s - start)


@pytest.mark.parametrize("seed", range(3))
def test_after_a_long_context_drafts_follow_its_cost_and_the_shape_stays(seed):
    short_curve, _, short_drafts, _ = run(64, seed)
    curve, machine, drafts, rate = run(5000, seed)
    # The rounds measured the context's share: the cost of 9 rows, in single steps, is the machine's.
    cost = curve.cost(9)
    truth = machine.shape(9, 5000)
    assert cost[-1] / cost[0] == pytest.approx(truth, rel=0.1)
    assert curve.report()["context_share_counts"] is True
    # ... and left the curve's own shape, the short context's, alone.
    assert np.allclose(curve.shape_of(9), SHORT[:9], rtol=0.05)
    assert np.allclose(short_curve.shape_of(9), SHORT[:9], rtol=0.05)
    # Drafts follow the cost at each context: long after a short one, next to none after a long one.
    assert np.mean(short_drafts[-100:]) >= 3.5
    assert np.mean(drafts[-100:]) <= 1.0


@pytest.mark.parametrize("seed", range(3))
def test_without_the_context_term_a_long_context_runs_slower(seed, monkeypatch):
    """The rule that fails when broken: sized on the short curve, drafts after a long context run
    too long, and the same generation takes longer."""
    *_, with_term = run(5000, seed)
    monkeypatch.setattr(by_context.ByContext, "extra", lambda self, now, cells, rows: None)
    *_, without = run(5000, seed)
    assert with_term > 1.15 * without


@pytest.mark.parametrize("seed", range(2))
def test_a_small_share_is_measured_and_reported_but_leaves_the_drafts_alone(seed, monkeypatch):
    """Below ACTS single steps on 2 rows (here 0.4 after 5,000 cells) the share is measured and
    reported, and the drafts are those the curve's own shape gives, round for round."""
    monkeypatch.setattr(__import__(__name__), "ATTEND", 8e-5)
    curve, machine, drafts, _ = run(5000, seed)
    report = curve.report()
    assert report["context_share_steps"] == pytest.approx(8e-5 * 5000, rel=0.25)
    assert report["context_share_counts"] is False
    monkeypatch.setattr(by_context.ByContext, "extra", lambda self, now, cells, rows: None)
    assert run(5000, seed)[2] == drafts
