"""ASD's rules, each on a hand-made case that fails if the rule is broken (docs/verifiers.md, "ASD")."""

import numpy as np
import pytest

from flylocal.decoding.verifiers.base import regrets
from flylocal.decoding.verifiers.asd import Asd, AsdParams, asd
from flylocal.decoding.verifiers.strict import strict

V = 8


def case(target, draft, gaps=None):
    """Logits with argmax `target` ([k+1] ids); at a mismatch j the draft token's logit sits
    gaps[j] below the target's (the regret), default 1.0."""
    gaps = gaps or {}
    logits = np.zeros((len(target), V), dtype=np.float32)
    for j, t in enumerate(target):
        logits[j, t] = 10.0
        if j < len(draft) and draft[j] != t:
            logits[j, draft[j]] = 10.0 - gaps.get(j, 1.0)
    d = np.asarray(draft, dtype=np.int32)
    a = logits.argmax(axis=1).astype(np.int32)
    assert a.tolist() == list(target)
    return d, a, logits


def run(d, a, z, g=1.0, M=3, B=100.0, spent=0.0):
    """(decision, the regret committing its whole accepted prefix costs)."""
    dec, cost = asd(d, a, z, AsdParams(gate=g, cap=M, budget=B), spent)
    assert len(cost) == dec.accepted
    return dec, float(cost[-1]) if len(cost) else 0.0


def test_regret_is_zero_at_native_matches_and_the_logit_gap_elsewhere():
    d, a, z = case([1, 2, 3, 4, 5], [1, 6, 3, 7], gaps={1: 0.75, 3: 2.5})
    assert regrets(d, a, z).tolist() == [0.0, 0.75, 0.0, 2.5]


def test_gate_depends_on_the_remaining_proposal_length():
    # regret 2.0 at j = 0 of k = 4: 2.0 / 4 = 0.5 <= g = 0.6, accepted with the native suffix
    d, a, z = case([1, 2, 3, 4, 5], [7, 2, 3, 4], gaps={0: 2.0})
    assert run(d, a, z, g=0.6)[0].accepted == 4
    # the same regret at j = 2 of k = 4: 2.0 / 2 = 1.0 > 0.6, rejected
    d, a, z = case([1, 2, 3, 4, 5], [1, 2, 7, 4], gaps={2: 2.0})
    assert run(d, a, z, g=0.6)[0].accepted == 2


def test_cap_limits_exceptions_per_round():
    d, a, z = case([1, 2, 3, 4, 5, 6], [7, 2, 7, 4, 7], gaps={0: 0.1, 2: 0.1, 4: 0.1})
    assert run(d, a, z, M=3)[0].accepted == 5
    assert run(d, a, z, M=2)[0].accepted == 4
    assert run(d, a, z, M=1)[0].accepted == 2


def test_budget_stops_acceptance_mid_draft():
    d, a, z = case([1, 2, 3, 4, 5, 6], [7, 2, 7, 4, 7], gaps={0: 1.0, 2: 1.0, 4: 1.0})
    dec, spend = run(d, a, z, B=2.5)
    assert dec.accepted == 4 and dec.loose == (0, 2) and spend == pytest.approx(2.0)
    dec, _ = run(d, a, z, B=2.5, spent=2.0)   # the same draft with most of the budget gone
    assert dec.accepted == 0


def test_budget_carries_across_rounds_and_runs_out():
    verifier = Asd(AsdParams(gate=1.0, cap=3, budget=2.5))
    d, a, z = case([1, 2, 3, 4], [7, 2, 3], gaps={0: 1.0})
    outcomes = []
    for _ in range(4):
        decision, _ = verifier.decide(d, a, z)
        outcomes.append(verifier.commit(decision, decision.accepted))
    assert [o.accepted for o in outcomes] == [3, 3, 0, 0]
    assert verifier.spent == pytest.approx(2.0)
    assert (outcomes[-1].budget_spent, outcomes[-1].budget_left) == (pytest.approx(2.0), pytest.approx(0.5))
    verifier.reset()
    assert verifier.decide(d, a, z)[0].accepted == 3


def test_only_committed_draft_tokens_are_charged():
    # exceptions at 1 and 3 are accepted, but an end-of-generation token (or max_tokens) cuts
    # the committed prefix at 2 draft tokens: only the regret of d[0..1] is charged
    verifier = Asd(AsdParams(gate=10.0, cap=3, budget=100.0))
    d, a, z = case([1, 2, 3, 4, 5], [1, 7, 3, 7], gaps={1: 0.5, 3: 2.0})
    decision, _ = verifier.decide(d, a, z)
    assert decision.accepted == 4 and verifier.spent == 0.0      # deciding charges nothing
    committed = verifier.commit(decision, 2)
    assert verifier.spent == pytest.approx(0.5)
    assert (committed.budget_spent, committed.budget_left) == (pytest.approx(0.5), pytest.approx(99.5))
    verifier.commit(verifier.decide(d, a, z)[0], 0)                         # nothing committed: nothing charged
    assert verifier.spent == pytest.approx(0.5)


def test_suffix_reuse_after_an_exception():
    # one exception at 1, then native matches: all of them are committed with it
    d, a, z = case([1, 2, 3, 4, 5, 6, 7], [1, 7, 3, 4, 5, 6], gaps={1: 0.5})
    dec, spend = run(d, a, z)
    assert dec.accepted == 6 and dec.loose == (1,) and spend == pytest.approx(0.5)
    assert strict(d, a, z).accepted == 1


def test_zero_budget_is_strict():
    rng = np.random.default_rng(1)
    for _ in range(200):
        k = int(rng.integers(0, 7))
        z = rng.normal(size=(k + 1, V)).astype(np.float32)
        a = z.argmax(axis=1).astype(np.int32)
        d = np.where(rng.random(k) < 0.6, a[:k], rng.integers(0, V, size=k)).astype(np.int32)
        dec, spend = run(d, a, z, g=100.0, M=10, B=0.0)
        assert dec.accepted == strict(d, a, z).accepted and spend == 0.0
    # an exact logit tie is still a mismatch: with B = 0 it is rejected like strict does
    d, a, z = case([1, 2, 3], [7, 2], gaps={0: 0.0})
    a = np.array([1, 2, 3], dtype=np.int32)
    assert run(d, a, z, B=0.0)[0].accepted == 0
