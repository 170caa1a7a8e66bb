"""Strict verification on literal arrays: L is the longest natively matching prefix."""

import numpy as np

from flylocal.decoding.verifiers import make_verifier
from flylocal.decoding.verifiers.strict import Strict, strict

V = 10


def logits(k):
    return np.zeros((k + 1, V), dtype=np.float32)


def arr(*xs):
    return np.array(xs, dtype=np.int32)


def test_stops_at_first_mismatch():
    d = strict(arr(5, 6, 7, 8), arr(5, 6, 1, 8, 3), logits(4))
    assert d.accepted == 2
    assert d.loose == ()


def test_full_match_takes_the_bonus_position():
    assert strict(arr(5, 6), arr(5, 6, 9), logits(2)).accepted == 2


def test_first_token_wrong_and_empty_draft():
    assert strict(arr(4, 6), arr(5, 6, 9), logits(2)).accepted == 0
    assert strict(arr(), arr(3), logits(0)).accepted == 0


def test_later_matches_do_not_count_after_a_mismatch():
    assert strict(arr(1, 2, 3), arr(1, 9, 3, 4), logits(3)).accepted == 1


def test_registry():
    assert isinstance(make_verifier("strict"), Strict)
