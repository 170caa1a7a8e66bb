"""The project's statistics, in one place: medians, percentile bootstrap intervals and the paired
tests that compare a method with a reference (docs/bench.md, "Methods side by side" and "Task scores").
Pure functions over numbers; bench, its report and task scores, `bench serve`, the thread
control and the cost curves all use these.

- `middle`: the middle value of timings (the upper one of two): a value that was measured, so
  one stall moves it no further than one place. What the thread control and the cost curves
  decide on.
- `median`: the median of figures (NaN left out; the mean of the two middle ones).
- `bootstrap`: a percentile bootstrap of any statistic of resampled rows, with a fixed seed so
  that a report is reproducible; `median_interval` and `mean_difference` are two of its uses.
- `mcnemar`: right/wrong answers, paired. Only discordant questions carry information: b the
  reference got right and the method wrong, c the other way. Given m = b + c, c is binomial with
  m trials and a chance π that a discordant question goes the method's way; the difference is
  100·m(2π − 1)/n. Its interval is the exact (Clopper-Pearson) interval of π through that line,
  its p-value the exact two-sided binomial test of π = 1/2. No discordant question gives [0, 0].
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

RESAMPLES = 2000         # bootstrap resamples, unless a caller says otherwise
ALPHA = 0.05             # every interval is a 95% one


def middle(values: Iterable[float]) -> float:
    """The middle of `values` (the upper of the two middle ones for an even count)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def median(values: Iterable[float]) -> float:
    """The median of `values`, NaN left out; NaN when none is left."""
    ordered = sorted(v for v in values if v == v)
    if not ordered:
        return float("nan")
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def bootstrap(rows, statistic: Callable, resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float] | None:
    """The 95% percentile interval of `statistic` over `resamples` resamplings of `rows` (with
    replacement, a fixed seed): `statistic` maps the resampled rows [resamples, n, ...] to one
    value each [resamples]; values that are not finite are left out. None where none is."""
    import numpy as np

    rows = np.asarray(rows, dtype=np.float64)                       # [n, ...]
    pick = np.random.default_rng(seed).integers(0, len(rows), size=(resamples, len(rows)))
    with np.errstate(divide="ignore", invalid="ignore"):
        values = np.asarray(statistic(rows[pick]), dtype=np.float64)     # [resamples]
    values = values[np.isfinite(values)]
    if not len(values):
        return None
    low, high = np.percentile(values, [100 * ALPHA / 2, 100 * (1 - ALPHA / 2)])
    return float(low), float(high)


def median_interval(ratios: Iterable[float], draws: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of `ratios` (NaN left out)."""
    import numpy as np

    r = [x for x in ratios if x == x]
    if len(r) < 2:
        return (float(r[0]), float(r[0])) if r else (float("nan"), float("nan"))
    return bootstrap(r, lambda s: np.median(s, axis=1), draws, seed)


def mean_difference(reference: list[float], method: list[float], resamples: int = RESAMPLES) -> dict:
    """The paired bootstrap of the mean difference `method` − `reference`: {diff, ci, p, lost,
    gained} (p: None, a bootstrap gives none)."""
    import numpy as np

    d = np.asarray(method, dtype=np.float64) - np.asarray(reference, dtype=np.float64)      # [n]
    if not len(d):
        return {"diff": 0.0, "ci": None, "p": None}
    low, high = bootstrap(d, lambda s: s.mean(axis=1), resamples)
    return {"diff": float(d.mean()), "ci": [low, high], "p": None, "lost": int((d < 0).sum()),
            "gained": int((d > 0).sum())}


def _binomial_cdf(x: int, m: int, p: float) -> float:
    """P(X <= x) for X ~ Binomial(m, p)."""
    if x < 0:
        return 0.0
    if x >= m or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    logs = [math.lgamma(m + 1) - math.lgamma(i + 1) - math.lgamma(m - i + 1) + i * math.log(p) + (m - i) * math.log1p(-p)
            for i in range(x + 1)]
    top = max(logs)
    return min(1.0, math.exp(top) * sum(math.exp(v - top) for v in logs))


def _solve(f, target: float) -> float:
    """The p in [0, 1] where the decreasing f(p) crosses `target` (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if f(mid) > target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def clopper_pearson(x: int, m: int, alpha: float = ALPHA) -> tuple[float, float]:
    """The exact 1 - alpha interval of a binomial proportion, x successes in m trials."""
    # the lower end for x successes is one less the upper end for the m - x failures
    low = 0.0 if x == 0 else 1.0 - _solve(lambda q: _binomial_cdf(m - x, m, q), alpha / 2)
    high = 1.0 if x == m else _solve(lambda p: _binomial_cdf(x, m, p), alpha / 2)
    return low, high


def mcnemar(reference: list[bool], method: list[bool]) -> dict:
    """The paired comparison of right/wrong answers (see the module docstring): {diff, ci, p,
    lost, gained}, on the 0-100 scale."""
    n = len(reference)
    b = sum(r and not s for r, s in zip(reference, method))      # lost
    c = sum(s and not r for r, s in zip(reference, method))      # gained
    m = b + c
    diff = 100.0 * (c - b) / n if n else 0.0
    if m == 0:
        return {"diff": diff, "ci": [0.0, 0.0], "p": 1.0, "lost": b, "gained": c}
    low, high = clopper_pearson(c, m)
    p = min(1.0, 2 * min(_binomial_cdf(b, m, 0.5), _binomial_cdf(c, m, 0.5)))
    return {"diff": diff, "ci": [100.0 * m * (2 * low - 1) / n, 100.0 * m * (2 * high - 1) / n], "p": p,
            "lost": b, "gained": c}
