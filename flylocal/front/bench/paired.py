"""A method's task score against the reference's, question by question (docs/design.md,
"Task scores"): the difference of the means, on the 0-100 scale, with a 95% interval.

- Right/wrong answers: McNemar's view. Only the discordant questions carry information: b the
  reference got right and the method wrong, c the other way. Given m = b + c, c is binomial
  with m trials and a chance π that a discordant question goes the method's way; the
  difference is m(2π - 1)/n. Its interval is the exact (Clopper-Pearson) interval of π mapped
  through that line, and its p-value the exact two-sided binomial test of π = 1/2 (McNemar's
  exact test). No discordant question gives the interval [0, 0]: it is conditional on what
  was seen.
- Scores (chrF, ROUGE-L, or right/wrong averaged over several seeds): a paired bootstrap. The
  questions are resampled with replacement (RESAMPLES, a fixed seed, so a report is
  reproducible) and the mean difference computed on each; the interval is the 2.5th and 97.5th
  percentiles.

A method *loses* when the whole interval lies below 0. It *keeps* the reference's score when
the interval reaches 0 or above, or when its loss is under KEEP_POINTS.
"""

from __future__ import annotations

import math

RESAMPLES = 2000
KEEP_POINTS = 1.0        # a loss under one point of the 0-100 scale is kept
ALPHA = 0.05


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
    """The paired comparison of right/wrong answers (see the module docstring)."""
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


def bootstrap(reference: list[float], method: list[float], resamples: int = RESAMPLES) -> dict:
    """The paired bootstrap of the mean difference of scores (see the module docstring)."""
    import numpy as np

    d = np.asarray(method, dtype=np.float64) - np.asarray(reference, dtype=np.float64)      # [n]
    if not len(d):
        return {"diff": 0.0, "ci": None, "p": None}
    pick = np.random.default_rng(0).integers(0, len(d), size=(resamples, len(d)))         # [resamples, n]
    means = d[pick].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return {"diff": float(d.mean()), "ci": [float(low), float(high)], "p": None,
            "lost": int((d < 0).sum()), "gained": int((d > 0).sum())}


def compare(reference: list[float], method: list[float], kind: str) -> dict:
    """`method`'s scores against `reference`'s on the same questions, in the same order:
    {diff, ci, p, lost, gained, loses, keeps}. Right/wrong tasks (`kind` "pass", scores 0 or 100)
    go through McNemar, anything else through the bootstrap."""
    if kind == "pass" and all(v in (0.0, 100.0) for v in (*reference, *method)):
        out = mcnemar([v > 0 for v in reference], [v > 0 for v in method])
    else:
        out = bootstrap(reference, method)
    ci = out["ci"]
    out["loses"] = ci is not None and ci[1] < 0
    out["keeps"] = ci is None or ci[1] >= 0 or -out["diff"] < KEEP_POINTS
    return out
