"""Calibrating a cost curve: a decode of each usual size timed in passes until the two lowest
times of each agree (docs/design.md, "Cost model"). A stall only ever adds time, so the lowest
counts. The result is settled when the passes agreed, the shape obeys physics, other work kept
the cores quiet meanwhile and the single step is not SLOWER than the rounds just before it;
otherwise it is provisional: used, never saved, measured again later."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from flylocal.decoding.costs import meter as meters
from flylocal.decoding.costs.shape import distortion, median
from flylocal.host import usable_cores

CALIBRATION_SIZES = (1, 2, 3, 5, 9, 17)
MIN_PASSES, MAX_PASSES = 3, 8
AGREE = 0.30             # the two lowest samples of a size within 30% (or ABS_AGREE seconds): a
                         # busy spell stalls decodes by 2-100x; on an idle 2-core VM a decode's
                         # time varies by 10-15%, and the two lowest of 8 by up to 27% at times
ABS_AGREE = 2e-4
SLOWER = 1.5             # a calibrated single step this much slower than the rounds before it: loaded


@dataclass(frozen=True)
class Calibration:
    seconds: np.ndarray      # [m] t(1..m), NaN where not measured
    meta: dict               # when, in how many passes, how spread, under what load; the row switch's cost
    problem: str | None      # why it is provisional; None: settled


def calibrate(timed_decode, max_rows: int, limit: int | None = None, meter=None,
              anchor: float | None = None) -> Calibration | None:
    """Measure t at the usual sizes and at `max_rows`, none above `limit` (the batch size). On a
    CPU the step from 1 to 2 rows is the steepest (a matrix-vector kernel gives way to a
    matrix-matrix one), so the small sizes are all measured. `timed_decode(n)` decodes n rows,
    rolls them back and returns the seconds taken. `anchor`: the seconds of the single-row
    rounds just before, when there were any. None when fewer than two sizes could be timed."""
    sizes = sorted(s for s in set(CALIBRATION_SIZES) | {max_rows} if limit is None or s <= limit)
    meter = meter if meter is not None else meters.CpuLoad()
    timed_decode(sizes[0])                  # the first decode pays for pages and buffers
    meter.start()
    samples: dict[int, list[float]] = {rows: [] for rows in sizes}
    back: list[float] = []                  # single steps right after a larger decode
    steady: list[float] = []                # single steps right after a single step
    passes = 0
    while passes < MAX_PASSES:
        # 1, 2, 1, 1, 3, 1, 1, ...: each size after a single step, as a draft's round comes;
        # after it a single step, which pays for changing the row count back, and another.
        for rows in sizes:
            t = timed_decode(rows)
            if t > 0 and math.isfinite(t):
                samples[rows].append(t)
            if rows > 1 and sizes[0] == 1:
                for kind in (back, steady):
                    t = timed_decode(1)
                    if t > 0 and math.isfinite(t):
                        kind.append(t)
        passes += 1
        if passes >= MIN_PASSES and all(_agree(v) for v in samples.values()):
            break
    busy = meter.stop()
    best = {rows: min(v) for rows, v in samples.items() if v}
    if len(best) < 2:
        return None
    values = np.full(max(best), np.nan)
    for rows, t in best.items():
        values[rows - 1] = t
    spread = max((sorted(v)[1] / sorted(v)[0] - 1) for v in samples.values() if len(v) >= 2)
    problem = distortion(values)
    if not all(_agree(v) for v in samples.values()):
        problem = problem or f"passes disagree by up to {spread:.0%}"
    if busy is not None and busy > meters.QUIET:
        problem = problem or f"{busy:.2f} cores were busy with other work"
    if anchor is not None and best[sizes[0]] > SLOWER * anchor:
        problem = problem or f"a single step took {best[sizes[0]] / anchor:.1f}x the rounds' just before"
    # Medians of as many samples each: the lowest of many is lower than the lowest of few.
    switch = max(median(back) - median(steady), 0.0) if back and steady else None
    meta = {"measured": time.strftime("%Y-%m-%dT%H:%M:%S"), "passes": passes,
            **({"switch": switch} if switch is not None else {}),
            "spread": round(float(spread), 4), "busy_cores": None if busy is None else round(busy, 3),
            "cores": usable_cores()}
    return Calibration(values, meta, problem)


def _agree(values: list[float]) -> bool:
    if len(values) < 2:
        return False
    a, b = sorted(values)[:2]
    return b <= a * (1 + AGREE) or b - a <= ABS_AGREE
