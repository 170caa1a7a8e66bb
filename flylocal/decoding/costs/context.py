"""A decode's cost by the length of the context it follows (docs/design.md, "Cost model").

Each row of a decode attends over every cached cell, so after a long context n rows cost more
single steps than the curve, calibrated after a short one, says. Measured on the Gemma stand-in
(scripts/experiments/prefill.py --rows, 2 cores): 8 rows cost 1.89 single steps after 1,024
cells, 2.54 after 4,096 and 2.76 after 8,192; 16 rows 2.82, 3.84 and 4.44. Drafts sized on the
short curve run too long there, or at all where a plain step would do.

The rounds measure it. Model: a decode of n rows after c cells takes

    t = S * (shape(n) + sigma * c * sqrt(n - 1))

with shape the curve's own, S the single step, and sigma the attention share beyond what the
shape already says, growing as the root of the rows past the first. The root, not a line: after
8,192 cells the excess over the short curve measured 0.29, 0.66, 0.87 and 1.62 steps for 2, 4,
8 and 16 rows, a power of about 0.6 in n - 1. S and sigma come from a least-squares fit over the
fresh rounds (within STALE seconds of decoding) that followed about as many cells (half to
twice), once they span two sizes; a round far off the fit (a stall) is dropped and the fit made
again. Before such evidence, and once it has expired, the curve's own shape holds.

The share counts in the cost only once it adds ACTS single steps or more to a decode of 2 rows
(sigma * c >= 1); from there on long rounds are not the shape's evidence (they never refine,
contradict or save it). Below that the rounds go on as at a short context, and the share is only
reported. Sized on a small share, drafts came out shorter than their acceptance repays: at ~8k
cells on the stand-in (a share of about 0.3 steps) strict-pld decoded 0.92x as fast with the
root form, 0.94x with a share linear in the rows. The acceptance estimates err low for what
drafts no longer try; a small share does not outweigh that, a large one (no draft pays) does.
"""

from __future__ import annotations

import math

import numpy as np

from flylocal.decoding.costs.check import STALE

LONG = 2048       # cells: from here on rounds measure the context's share, not the curve's shape
ROUNDS = 32       # long rounds kept
FEW = 6           # rounds a fit needs
OFF = 0.5         # a round more than this share off the fit is a stall
ACTS = 1.0        # single steps the share must add to 2 rows before it counts in the cost (below, measured to lose)


class ByContext:
    """The context term of one cost curve, from its long rounds."""

    def __init__(self):
        self.rounds: list[tuple[float, int, int, float, float]] = []   # (decoded_s, cells, rows, seconds, shape)
        self._memo: tuple | None = None                                # ((now, cells // 256), sigma)

    def update(self, now: float, cells: int, rows: int, seconds: float, shape: float) -> None:
        """A round after `cells` cells of `rows` rows took `seconds`; the curve says `shape`
        single steps for `rows` rows."""
        self.rounds = (self.rounds + [(now, cells, rows, seconds, shape)])[-ROUNDS:]
        self._memo = None

    def share(self, now: float, cells: int) -> float | None:
        """sigma after about `cells` cells (the model above), or None where the rounds cannot
        tell: too few, or all of one size."""
        key = (now, cells // 256)
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1]
        near = np.array([(c * math.sqrt(n - 1), shape, t) for when, c, n, t, shape in self.rounds
                         if now - when <= STALE and cells / 2 <= c <= cells * 2]).reshape(-1, 3)
        sigma = None
        for _ in range(2):                       # fit, drop the stalls, fit again
            if len(near) < FEW or len(np.unique(near[:, 1])) < 2:
                break
            (a, b), *_ = np.linalg.lstsq(near[:, [1, 0]], near[:, 2], rcond=None)
            if not a > 0:
                break
            sigma = max(b / a, 0.0)
            fit = a * near[:, 1] + b * near[:, 0]
            near = near[np.abs(near[:, 2] - fit) <= OFF * fit]
        self._memo = key, sigma
        return sigma

    def extra(self, now: float, cells: int, rows: int) -> np.ndarray | None:
        """[rows] single steps to add to the curve's shape after `cells` cells: sigma * c * sqrt(n - 1);
        None where the context is short or nothing is known."""
        if cells < LONG or (sigma := self.share(now, cells)) is None or sigma * cells < ACTS:
            return None
        return sigma * cells * np.sqrt(np.arange(rows, dtype=np.float64))

    def report(self, now: float, cells: int) -> dict:
        """For the curve's report: the share a decode of 2 rows pays after `cells` cells, in
        single steps, and whether it counts (ACTS); nothing where the rounds cannot tell."""
        sigma = self.share(now, cells) if cells >= LONG else None
        if sigma is None:
            return {}
        return {"context_cells": cells, "context_share_steps": round(sigma * cells, 3),
                "context_share_counts": bool(sigma * cells >= ACTS)}
