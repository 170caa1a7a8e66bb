"""Draft-length control: choices follow measured cost and acceptance."""

import numpy as np

from flylocal.adaptive import DraftLength

PRIOR = np.array([0.2, 0.5, 0.9])


def calibrated(cost_per_extra_row, k_max=8, single=0.01):
    dl = DraftLength(k_max, PRIOR)
    dl.calibrate(lambda rows: single * (1 + cost_per_extra_row * (rows - 1)))
    return dl


def test_flat_cost_drafts_everything_offered():
    # A GPU-like cost curve: verifying 9 rows costs what 1 does. Any acceptance pays.
    dl = calibrated(0.0)
    assert dl.choose(level=0, available=8) == 8
    assert dl.choose(level=2, available=5) == 5


def test_steep_cost_and_weak_evidence_means_no_draft():
    # A CPU-like curve: each row costs 60% of a step; a 20% acceptance never pays.
    dl = calibrated(0.6)
    assert dl.choose(level=0, available=8) == 0


def test_acceptance_history_moves_the_choice():
    dl = calibrated(0.3)
    before = dl.choose(level=1, available=8)
    for _ in range(30):
        dl.update(level=1, k=8, accepted=8, seconds=0.01 * (1 + 0.3 * 8))
    # the whole draft, with the evidence; the streak row's prior alone would give 4
    assert before < dl.choose(level=1, available=8) == 8
    for _ in range(60):
        dl.update(level=1, k=4, accepted=0, seconds=0.01 * (1 + 0.3 * 4))
    assert not dl.streak
    assert dl.choose(level=1, available=8) == 0


def test_measured_round_times_replace_the_calibration():
    dl = calibrated(0.0)
    assert dl.choose(level=1, available=8) == 8
    for _ in range(40):   # rounds of 9 rows turn out 20x slower than calibrated, all accepted
        dl.update(level=1, k=8, accepted=8, seconds=0.2)
    assert dl.choose(level=1, available=8) < 8
