"""Draft length from measured cost and acceptance.

Verifying k drafted tokens costs one target decode of k+1 rows. On a GPU that is nearly flat
in k; on a 2-core CPU 8 rows cost 3-4 single steps (docs/design.md, "Cost model"), so a long, poorly grounded draft
is slower than no draft at all. Each round this controller picks the draft length that
maximises expected committed tokens per second:

    E(k) = 1 + sum_{j<k} prod_{i<=j} alpha[level, i]        (tokens emitted by the round)
    rate(k) = E(k) / t(k+1)                                   (t: measured decode seconds)

`alpha[level, i]` is the measured probability that draft position i is accepted given that
positions before it were, per confidence level (for prompt lookup: the n-gram size that
matched). k = 0 (a plain step) wins whenever no draft is expected to pay for itself.
"""

from __future__ import annotations

import time

import numpy as np

# A drafter's prior acceptance per confidence level is worth PRIOR_WEIGHT observations;
# measurements replace it within a few rounds.
PRIOR_WEIGHT = 2.0
PRIOR_ROW_COST = 0.4     # extra cost of one more row relative to a single-row decode (CPU-like)
STREAK_PRIOR = 0.85
DECAY = 0.98             # per round, every level drifts back toward its prior: old evidence fades
COST_EMA = 0.2


class DraftLength:
    def __init__(self, k_max: int, prior: np.ndarray):
        """prior [levels] float64: the drafter's prior per-position acceptance by level."""
        self.k_max = k_max
        levels = len(prior)
        # Rows [levels:] are the same levels right after a round that accepted its whole draft:
        # a copy in progress, which is far more reliable than the n-gram size alone says.
        self.levels = levels
        prior = np.concatenate([prior, np.maximum(prior, STREAK_PRIOR)])
        self.streak = False
        self.hits = np.repeat(prior[:, None] * PRIOR_WEIGHT, k_max, axis=1)   # [2*levels, k_max]
        self.tries = np.full((2 * levels, k_max), PRIOR_WEIGHT)                    # [2*levels, k_max]
        self._prior_hits = self.hits.copy()
        self.seconds = np.full(k_max + 1, np.nan)                              # [k_max+1] by rows-1
        self._cost_cache: np.ndarray | None = None

    def _cost(self) -> np.ndarray:
        """Estimated seconds of a decode with n = 1..k_max+1 rows: [k_max+1]. Measured sizes
        use their running mean; the others are interpolated between measured sizes, or follow
        the prior's shape when fewer than two sizes have been measured."""
        if self._cost_cache is not None:
            return self._cost_cache
        rows = np.arange(1, self.k_max + 2, dtype=np.float64)
        seen = np.flatnonzero(~np.isnan(self.seconds))
        if seen.size >= 2:
            cost = np.interp(rows, rows[seen], self.seconds[seen])
        else:
            cost = 1 + PRIOR_ROW_COST * (rows - 1)
            if seen.size:
                cost *= self.seconds[seen[0]] / cost[seen[0]]
        self._cost_cache = cost
        return cost

    @property
    def calibrated(self) -> bool:
        return int((~np.isnan(self.seconds)).sum()) >= 2

    def calibrate(self, timed_decode) -> None:
        """Measure the decode cost at a few batch sizes before the first round, so the first
        choices use this machine's cost curve rather than the prior's. On a CPU the step from
        1 to 2 rows is the steepest (a matrix-vector kernel gives way to a matrix-matrix one),
        so the small sizes are all measured. `timed_decode(n)` decodes n rows, rolls them
        back, and returns the seconds taken; the best of two tries counts."""
        sizes = sorted({1, 2, 3, 5, self.k_max + 1} & set(range(1, self.k_max + 2)))
        for rows in sizes + sizes:
            seconds = timed_decode(rows)
            old = self.seconds[rows - 1]
            self.seconds[rows - 1] = seconds if np.isnan(old) else min(old, seconds)
        self._cost_cache = None

    def choose(self, level: int, available: int) -> int:
        """How many of `available` proposed tokens to verify this round. Acceptance is measured
        as committed, so a loose verifier's extra acceptance on long drafts counts in favour
        of long drafts."""
        k = min(available, self.k_max)
        if k <= 0:
            return 0
        row = level + self.levels * self.streak
        alpha = self.hits[row, :k] / self.tries[row, :k]
        expected = 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(alpha))])   # [k+1]: E(0..k)
        rate = expected / self._cost()[: k + 1]
        return int(np.argmax(rate))

    def update(self, level: int, k: int, accepted: int, seconds: float) -> None:
        """Record a round that verified k tokens, accepted `accepted` of them, in `seconds`."""
        self.hits = self._prior_hits + DECAY * (self.hits - self._prior_hits)
        self.tries = PRIOR_WEIGHT + DECAY * (self.tries - PRIOR_WEIGHT)
        if k > 0:
            row = level + self.levels * self.streak
            reached = min(accepted + 1, k)          # positions that were actually decided
            self.tries[row, :reached] += 1.0
            self.hits[row, :accepted] += 1.0
        self.streak = k > 0 and accepted >= k
        old = self.seconds[k]
        self.seconds[k] = seconds if np.isnan(old) else (1 - COST_EMA) * old + COST_EMA * seconds
        self._cost_cache = None


def timed_decode(runtime, token: int, rows: int) -> float:
    """Seconds for one decode of `rows` copies of `token` with logits on every row, rolled back
    after: a calibration probe for DraftLength. NaN when the context has no room."""
    n_past = runtime.n_past
    if n_past + rows > runtime.n_ctx:
        return float("nan")
    t0 = time.perf_counter()
    logits = runtime.decode(np.full(rows, token, dtype=np.int32), logits_from=0)
    logits.argmax(axis=1)
    runtime.truncate(n_past)
    return time.perf_counter() - t0
