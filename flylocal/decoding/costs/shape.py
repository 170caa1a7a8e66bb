"""What a decode's cost curve can be (docs/design.md, "Cost model"): the prior before anything
is measured, interpolation between measured sizes, and the physics a measured curve must obey
(n rows never dearer than PHYSICS * n single steps, never much cheaper than one, and a single
step neither under FASTEST nor over SLOWEST seconds)."""

from __future__ import annotations

import numpy as np

PRIOR_ROW_COST = 0.4     # extra cost of one more row relative to a single-row decode (CPU-like)
PHYSICS = 1.5            # at most 1.5 * n: batching never makes a row dearer than a step of its own
FLOOR = 0.7              # at least 0.7: more rows are never much cheaper than one
FAR = 3.0                # a refined shape more than 3x from the calibrated one (either way) is a stall
FASTEST = 1e-6           # seconds: no single-row decode takes less (a GPU kernel launch alone takes more)
SLOWEST = 3600.0         # seconds: nor more (a cache file saying so is absurd, not a slow model)
SWITCH_MAX = PHYSICS - 1  # single steps: the step back to one row is a single-row decode, at most PHYSICS steps
SAVE_SAMPLES = 5         # a refinement is saved from at least 5 samples of a size ...
AGREE_REFINED = 0.25     # ... whose (q75 - q25) / median is within this


def prior_shape(rows: int) -> np.ndarray:
    """The CPU-like shape assumed before anything is measured: [rows] float64."""
    return 1 + PRIOR_ROW_COST * np.arange(rows, dtype=np.float64)


def interpolate(values: np.ndarray, rows: int) -> np.ndarray:
    """t(1..rows) [rows] float64 from measured values [m] (NaN where not measured): interpolated
    between measured sizes, along the last slope past the largest, the prior's shape with fewer
    than two."""
    n = np.arange(1, rows + 1, dtype=np.float64)
    seen = np.flatnonzero(~np.isnan(values))
    if seen.size >= 2:
        x, y = seen + 1.0, values[seen]
        cost = np.interp(n, x, y)
        slope = max((y[-1] - y[-2]) / (x[-1] - x[-2]), 0.0)
        beyond = n > x[-1]
        cost[beyond] = y[-1] + slope * (n[beyond] - x[-1])
        return cost
    return prior_shape(rows) * ((values[seen[0]] / (1 + PRIOR_ROW_COST * seen[0])) if seen.size else 0.01)


def distortion(seconds: np.ndarray) -> str | None:
    """Why calibrated times [m] (NaN where not measured) cannot be a decode's cost curve, or None."""
    seen = np.flatnonzero(~np.isnan(seconds))
    if seen.size < 2 or seen[0] != 0:
        return "no single-row time" if seen.size else "nothing measured"
    if not FASTEST <= seconds[0] <= SLOWEST:
        return f"a single step of {seconds[0]:.3g} s (none takes under {FASTEST:g} s or over {SLOWEST:g} s)"
    shape = seconds[seen] / seconds[0]
    for n, s in zip(seen + 1, shape):
        if s > PHYSICS * n:
            return f"{n} rows cost {s:.1f} single steps (at most {PHYSICS:g} x {n} can be real)"
        if s < FLOOR:
            return f"{n} rows cost {s:.2f} of a single step (a single row measured slow)"
    return None


def fill(values: np.ndarray, other: np.ndarray, between: bool = True) -> np.ndarray | None:
    """Times measured so far [m] (NaN where not yet), the sizes not measured taken from
    another curve's shape [m'] in their single step (`between`: interpolated at every size,
    else only where `other` measured them); None where that breaks physics."""
    size = max(len(values), len(other))
    shape = interpolate(other, size) if between else np.concatenate([other, np.full(size - len(other), np.nan)])
    start = shape / interpolate(other, 1)[0] * values[0]
    start[: len(values)] = np.where(np.isnan(values), start[: len(values)], values)
    return start if distortion(start) is None else None


def consistent(samples: dict[int, list[float]], size: int) -> np.ndarray:
    """The refined shape that may be saved from rounds' samples (rows -> shape samples): per
    size with SAVE_SAMPLES samples or more whose middle half agrees within AGREE_REFINED, their
    lower quartile; NaN elsewhere. [max(size, largest rows)] float64."""
    out = np.full(max(size, max(samples, default=0)), np.nan)
    for n, values in samples.items():
        if len(values) >= SAVE_SAMPLES:
            q25, q50, q75 = np.percentile(values, [25, 50, 75])
            if (q75 - q25) / q50 <= AGREE_REFINED:
                out[n - 1] = q25
    return out


def plausible(rows: int, r: float, calibrated: float) -> bool:
    """Whether r single steps can be what `rows` rows cost, the calibration saying `calibrated`."""
    return FLOOR <= r <= PHYSICS * rows and calibrated / FAR <= r <= calibrated * FAR
