"""FLy's rules, each on a hand-made case that fails if the rule is broken (docs/design.md, "FLy")."""

import math

import numpy as np
import pytest

from flylocal.decoding.verifiers.base import emitted_tokens
from flylocal.decoding.verifiers.fly import FlyParams, fly, topk_entropy
from flylocal.decoding.verifiers.strict import strict

V = 16
UNSURE, SURE = "unsure", "sure"


def case(target, draft, unsure=()):
    """Target logits whose argmax is `target` ([k+1] ids). Rows in `unsure` are nearly flat
    (top-3 entropy about 0.6 nats); the others are confident (entropy about 0)."""
    k1 = len(target)
    logits = np.zeros((k1, V), dtype=np.float32)
    for j, t in enumerate(target):
        if j in unsure:
            logits[j, :] = 1.0
            logits[j, t] = 1.2
        else:
            logits[j, t] = 20.0
    d = np.asarray(draft, dtype=np.int32)
    a = logits.argmax(axis=1).astype(np.int32)
    assert a.tolist() == list(target)
    return d, a, logits


P = FlyParams(window=3, entropy=0.3, topk=3)


def test_topk_entropy_matches_a_direct_softmax():
    rng = np.random.default_rng(0)
    z = rng.normal(size=1000).astype(np.float32) * 3
    p = np.exp(z.astype(np.float64) - z.max())
    p /= p.sum()
    top = np.sort(p)[-3:]
    assert topk_entropy(z, 3) == pytest.approx(float(-(top * np.log(top)).sum()), rel=1e-5)


def test_gate_rejects_a_low_entropy_mismatch():
    # mismatch at 1 with a full window after it, but the target is confident there
    d, a, z = case([1, 2, 3, 4, 5, 6, 7], [1, 9, 3, 4, 5, 6])
    dec = fly(d, a, z, P)
    assert dec.accepted == 1 and dec.loose == ()
    assert dec.entropy[1] < 0.3


def test_window_accepts_high_entropy_mismatch_followed_by_native_matches():
    # W = 3: mismatch at 1, then 2 native matches (2, 3), and 1 + 3 < 6
    d, a, z = case([1, 2, 3, 4, 5, 6, 7], [1, 9, 3, 4, 5, 6], unsure={1})
    dec = fly(d, a, z, P)
    assert dec.loose == (1,)
    assert dec.accepted == 6
    assert dec.entropy[1] > 0.3 and np.isnan(dec.entropy[[0, 2, 3, 4, 5]]).all()


def test_second_mismatch_inside_the_window_spoils_it():
    d, a, z = case([1, 2, 3, 4, 5, 6, 7], [1, 9, 3, 9, 5, 6], unsure={1, 3})
    dec = fly(d, a, z, P)
    assert dec.accepted == 1 and dec.loose == ()


def test_mismatch_whose_window_reaches_the_end_is_rejected():
    # k = 5, W = 3: j = 2 gives j + W = 5 >= k, although the matches after it are native
    d, a, z = case([1, 2, 3, 4, 5, 6], [1, 2, 9, 4, 5], unsure={2})
    assert fly(d, a, z, P).accepted == 2
    # one token more and the same mismatch is accepted (j + W = 5 < 6)
    d, a, z = case([1, 2, 3, 4, 5, 6, 7], [1, 2, 9, 4, 5, 6], unsure={2})
    assert fly(d, a, z, P).accepted == 6


def test_two_separate_windows_in_one_draft():
    d, a, z = case([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [9, 2, 3, 9, 5, 6, 7, 8, 9], unsure={0, 3})
    dec = fly(d, a, z, P)
    assert dec.loose == (0, 3)
    assert dec.accepted == 9


def test_no_window_ablation_accepts_a_gated_open_mismatch_at_once():
    # the mismatch at 3 sits at the end of the draft and is followed by another mismatch
    d, a, z = case([1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9], unsure={3, 4})
    assert fly(d, a, z, P).accepted == 3
    dec = fly(d, a, z, FlyParams(window=3, entropy=0.3, topk=3, use_window=False))
    assert dec.loose == (3, 4) and dec.accepted == 5
    # the gate still applies without the window
    d, a, z = case([1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9], unsure={3})
    assert fly(d, a, z, FlyParams(window=3, use_window=False)).accepted == 4


def test_decisions_come_from_native_matches_only():
    # Mismatch at 1 has in its window a mismatch at 2. Position 2 on its own would have a full
    # window (3, 4 native; 2 + 3 < 7) and could become loose; it must not rescue position 1.
    d, a, z = case([1, 2, 3, 4, 5, 6, 7, 8], [1, 9, 9, 4, 5, 6, 7], unsure={1, 2})
    dec = fly(d, a, z, P)
    assert dec.accepted == 1 and dec.loose == ()


def test_correction_token_is_the_target_argmax_at_L():
    d, a, z = case([1, 2, 3, 4, 5, 6, 7, 8], [9, 2, 3, 4, 8, 6, 7], unsure={0})
    dec = fly(d, a, z, P)
    assert dec.loose == (0,) and dec.accepted == 4
    out = emitted_tokens(d, a, dec.accepted)
    assert out.tolist() == [9, 2, 3, 4, 5]      # the loose draft token stays; a[4] = 5 corrects d[4] = 8


def test_theta_zero_and_infinity():
    d, a, z = case([1, 2, 3, 4, 5, 6, 7], [1, 9, 3, 4, 5, 6])   # confident mismatch
    assert fly(d, a, z, FlyParams(window=3, entropy=0.0)).loose == (1,)       # no gate
    for unsure in ({1}, set()):
        d, a, z = case([1, 2, 3, 4, 5, 6, 7], [1, 9, 3, 4, 5, 6], unsure=unsure)
        assert fly(d, a, z, FlyParams(window=3, entropy=math.inf)).accepted == strict(d, a, z).accepted == 1


def test_all_native_and_empty_drafts():
    d, a, z = case([1, 2, 3, 4], [1, 2, 3])
    assert fly(d, a, z, P).accepted == 3
    d, a, z = case([1], [])
    assert fly(d, a, z, P).accepted == 0
