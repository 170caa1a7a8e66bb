"""Draft-length control: choices follow measured cost and acceptance."""

import numpy as np
import pytest

from flylocal.decoding.adaptive import DraftLength

PRIOR = np.array([0.2, 0.5, 0.9])


def calibrated(cost_per_extra_row, k_max=8, single=0.01):
    dl = DraftLength(k_max, PRIOR)
    dl.curve.calibrate(lambda rows: single * (1 + cost_per_extra_row * (rows - 1)), k_max + 1)
    return dl


def test_flat_cost_drafts_everything_offered():
    # A GPU-like cost curve: verifying 9 rows costs what 1 does. Any acceptance pays.
    dl = calibrated(0.0)
    assert dl.best(row=0, available=8) == 8
    assert dl.best(row=2, available=5) == 5


def test_steep_cost_and_weak_evidence_means_no_draft():
    # A CPU-like curve: each row costs 60% of a step; a 20% acceptance never pays.
    dl = calibrated(0.6)
    assert dl.best(row=0, available=8) == 0


def test_acceptance_history_moves_the_choice():
    dl = calibrated(0.3)
    before = dl.best(row=1, available=8)
    for _ in range(30):
        dl.update(row=1, k=8, accepted=8, seconds=0.01 * (1 + 0.3 * 8))
    # the whole draft, with the evidence; the streak row's prior alone would give 4
    assert before < dl.best(row=1, available=8) == 8
    for _ in range(60):
        dl.update(row=1, k=4, accepted=0, seconds=0.01 * (1 + 0.3 * 4))
    assert dl.best(row=1, available=8) == 0


def test_rounds_that_find_a_size_dearer_than_calibrated_shorten_drafts():
    dl = calibrated(0.0)
    assert dl.best(row=0, available=8) == 8
    for _ in range(10):   # 9-row rounds cost 2.5 single-row rounds, where the calibration said 1
        dl.update(row=0, k=0, accepted=0, seconds=0.01)
        dl.update(row=0, k=8, accepted=0, seconds=0.025)
    assert dl.curve.shape(9) == pytest.approx(2.5)
    assert dl.best(row=0, available=8) < 8


def test_a_machine_slower_everywhere_changes_no_draft_length():
    """Load slows every size alike: the speed changes, the shape and the choice do not."""
    dl = calibrated(0.3)
    before = [dl.best(level, 8) for level in range(3)]
    for _ in range(20):
        dl.update(row=1, k=0, accepted=0, seconds=0.01 * 10)
        dl.update(row=1, k=4, accepted=2, seconds=0.01 * (1 + 0.3 * 4) * 10)
    assert dl.curve.speed() == pytest.approx(0.1)
    assert dl.curve.shape(5) == pytest.approx(1 + 0.3 * 4)
    dl.hits, dl.tries = dl._prior_hits.copy(), np.full_like(dl.tries, 2.0)      # the prior again
    assert [dl.best(level, 8) for level in range(3)] == before
