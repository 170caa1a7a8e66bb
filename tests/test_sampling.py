"""Sampling at temperature > 0: strict speculative sampling is lossless, and the test can fail.

Statistical checks are seeded, and the CPU build is batch-invariant, so they are deterministic.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from flylocal.drafters import make_drafter
from flylocal.engine import Engine, EngineConfig, generate_all
from flylocal.sampling import SamplingParams, processed_probs, sample_targets
from flylocal.verifiers.base import Decision
from flylocal.verifiers.strict import strict


def critical(df: int, z: float = 3.09) -> float:
    """Chi-square critical value at alpha = 0.001 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(observed: Counter, expected: dict, n: int) -> tuple[float, int]:
    """Goodness of fit over categories with expected count >= 5; the rest pooled as 'other'."""
    cats = [c for c, p in expected.items() if p * n >= 5]
    exp = [expected[c] * n for c in cats]
    obs = [observed.get(c, 0) for c in cats]
    rest_e, rest_o = n - sum(exp), n - sum(obs)
    if rest_e >= 5:
        exp.append(rest_e)
        obs.append(rest_o)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return stat, len(exp) - 1


# ----- pure functions -----

def test_processed_probs_filters_in_llama_cpp_order():
    z = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05], dtype=np.float32))
    ids, p = processed_probs(z, np.array([], dtype=np.int32), SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0))
    assert ids.tolist() == [0, 1, 2, 3, 4] and p == pytest.approx([0.5, 0.2, 0.15, 0.1, 0.05])
    ids, _ = processed_probs(z, np.array([], dtype=np.int32), SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0))
    assert ids.tolist() == [0, 1, 2]
    ids, _ = processed_probs(z, np.array([], dtype=np.int32), SamplingParams(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0))
    assert ids.tolist() == [0, 1, 2]            # 0.5 + 0.2 < 0.8 <= 0.85
    ids, _ = processed_probs(z, np.array([], dtype=np.int32), SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.25))
    assert ids.tolist() == [0, 1, 2]            # >= 0.125
    _, p = processed_probs(z, np.array([], dtype=np.int32), SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0))
    assert p[0] == pytest.approx(0.25 / (0.25 + 0.04 + 0.0225 + 0.01 + 0.0025))
    z2 = np.array([2.0, 1.9, 0.0], dtype=np.float32)  # the penalty sees the history only
    ids, _ = processed_probs(z2, np.array([0], dtype=np.int32),
                             SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.5))
    assert ids[0] == 1


@pytest.mark.parametrize("draft_token", [0, 2, 4])
def test_sampled_targets_follow_q_whatever_the_draft(draft_token):
    rng = np.random.default_rng(0)
    z = np.log(np.array([[0.4, 0.3, 0.15, 0.1, 0.05], [0.2] * 5], dtype=np.float32))
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    d = np.array([draft_token], dtype=np.int32)
    n = 20000
    counts = Counter(int(sample_targets(d, z, np.zeros(0, dtype=np.int32), p, rng)[0]) for _ in range(n))
    stat, df = chi_square(counts, dict(enumerate([0.4, 0.3, 0.15, 0.1, 0.05])), n)
    assert stat < critical(df)
    # the match probability is as high as a sample from q allows: q(d)
    assert counts[draft_token] / n == pytest.approx([0.4, 0.3, 0.15, 0.1, 0.05][draft_token], abs=0.015)


# ----- real models -----

RAW = "one two three four five six seven. one two three four five six seven. one two three"
SETTINGS = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
N = 700


def accept_all(draft, target_argmax, logits):
    """A deliberately wrong rule: commit every draft token."""
    return Decision(accepted=len(draft))


def expected_pairs(rt, ids, p: SamplingParams, top: int = 6) -> dict:
    """Exact P(x1, x2) of plain sampling for the `top` most likely first tokens."""
    rt.reset()
    rt.decode(ids[:-1])
    z0 = rt.decode(ids[-1:], logits_from=0)[0].copy()
    ids0, p0 = processed_probs(z0, ids, p)
    out = {}
    for x1, q1 in zip(ids0[:top], p0[:top]):
        ctx = np.append(ids, x1).astype(np.int32)
        rt.reset()
        rt.decode(ctx[:-1])
        z1 = rt.decode(ctx[-1:], logits_from=0)[0].copy()
        ids1, p1 = processed_probs(z1, ctx, p)
        for x2, q2 in zip(ids1, p1):
            out[(int(x1), int(x2))] = float(q1 * q2)
    return out


def sample_pairs(target, drafter, verifier, ids, k, n=N):
    engine = Engine(target, drafter, verifier, EngineConfig(max_tokens=2, k=k, adaptive=False, sampling=SETTINGS))
    pairs, drafted = Counter(), 0
    for _ in range(n):
        tokens, stats, _ = generate_all(engine, ids)
        pairs[tuple(tokens[:2])] += 1
        drafted += stats.drafted
    return pairs, drafted


@pytest.fixture(scope="module")
def raw_case(smol):
    ids = smol.tokenize(RAW)
    return ids, expected_pairs(smol, ids, SETTINGS)


@pytest.mark.parametrize("drafter,k", [("none", 0), ("pld", 4), ("model", 3)])
def test_strict_speculative_sampling_matches_plain_sampling(smol, smol_draft, raw_case, drafter, k):
    ids, expected = raw_case
    pairs, drafted = sample_pairs(smol, make_drafter(drafter, smol, smol_draft), strict, ids, k)
    assert drafted > 0 or drafter == "none"
    stat, df = chi_square(pairs, expected, N)
    assert df >= 3 and stat < critical(df), (stat, df)


def test_a_wrong_acceptance_rule_fails_the_same_test(smol, raw_case):
    ids, expected = raw_case
    pairs, drafted = sample_pairs(smol, make_drafter("pld", smol), accept_all, ids, 4)
    assert drafted > 0
    stat, df = chi_square(pairs, expected, N)
    assert stat > critical(df)


def test_same_seed_same_tokens(smol, smol_draft):
    ids = smol.tokenize("Write a haiku about rain.")
    runs = []
    for seed in (5, 5, 6):
        cfg = EngineConfig(max_tokens=24, k=4, adaptive=False,
                           sampling=SamplingParams(temperature=0.9, seed=seed))
        engine = Engine(smol, make_drafter("model", smol, smol_draft), strict, cfg)
        runs.append(generate_all(engine, ids)[0])
    assert runs[0] == runs[1] and runs[0] != runs[2]
