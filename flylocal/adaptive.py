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

t(n) comes from a CostCurve: measured once per model file, build, backend, thread count and
batch size, cached on disk (`$FLYLOCAL_COSTS` or ~/.cache/flylocal/costs), refined from the
rounds actually run, and shared by everything that drafts for that model in one process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

# A drafter's prior acceptance per confidence level is worth PRIOR_WEIGHT observations;
# measurements replace it within a few rounds.
PRIOR_WEIGHT = 2.0
PRIOR_ROW_COST = 0.4     # extra cost of one more row relative to a single-row decode (CPU-like)
STREAK_PRIOR = 0.85
DECAY = 0.98             # per round, every level drifts back toward its prior: old evidence fades
COST_EMA = 0.2
CALIBRATION_SIZES = (1, 2, 3, 5, 9, 17)
COST_FORMAT = 1


def _interpolate(values: np.ndarray, rows: int) -> np.ndarray:
    """t(1..rows) [rows] float64 from measured values [m] (NaN where not measured): interpolated
    between measured sizes, along the last slope past the largest, the prior's CPU-like shape
    with fewer than two."""
    n = np.arange(1, rows + 1, dtype=np.float64)
    seen = np.flatnonzero(~np.isnan(values))
    if seen.size >= 2:
        x, y = seen + 1.0, values[seen]
        cost = np.interp(n, x, y)
        slope = max((y[-1] - y[-2]) / (x[-1] - x[-2]), 0.0)
        beyond = n > x[-1]
        cost[beyond] = y[-1] + slope * (n[beyond] - x[-1])
        return cost
    cost = 1 + PRIOR_ROW_COST * (n - 1)
    return cost * ((values[seen[0]] / (1 + PRIOR_ROW_COST * seen[0])) if seen.size else 0.01)


def costs_dir() -> Path:
    return Path(os.environ.get("FLYLOCAL_COSTS") or Path.home() / ".cache" / "flylocal" / "costs")


class CostCurve:
    """Seconds of one decode of n rows, all with logits, on one loaded model: t(n).

    `seconds` [max_rows] holds t(1..max_rows), NaN where not measured. Sizes in between are
    interpolated; past the largest measured size t grows along the last measured slope; with
    fewer than two sizes measured it follows the prior's CPU-like shape. `key` identifies what
    the curve is valid for (model file, build, backend, threads, batch size); with a key the
    curve is read from and written to the disk cache. A `fixed` curve never changes (tests,
    and a cost model given by hand).

    Rounds refine `seconds` as they go (`update`). `base` keeps the calibrated values, which
    change only when the curve is measured again; a `pinned` curve answers from `base` and
    ignores updates, so that decisions made on it do not depend on this run's timings (a
    seeded run, whose tokens must not follow the machine's load)."""

    def __init__(self, key: dict | None = None, seconds=None, fixed: bool = False):
        self.key = key
        self.fixed = fixed
        self._memo: dict[int, np.ndarray] = {}
        self._shapes: dict[int, float] = {}      # shape(rows), until `base` changes
        self.seconds = np.full(max(CALIBRATION_SIZES), np.nan)
        self.pinned = False
        if seconds is not None:
            self._set(seconds)
        self.base = self.seconds.copy()
        self.source = "given" if seconds is not None else "none"   # "cache", "measured", "given"
        self.dirty = False
        self._ensured = 0

    def _set(self, seconds) -> None:
        seconds = np.asarray(seconds, dtype=np.float64)
        if len(seconds) > len(self.seconds):
            self.seconds = np.concatenate([self.seconds, np.full(len(seconds) - len(self.seconds), np.nan)])
        self.seconds[: len(seconds)] = seconds
        self._memo.clear()

    @property
    def calibrated(self) -> bool:
        return int((~np.isnan(self.seconds)).sum()) >= 2

    def pin(self, pinned: bool) -> None:
        """Answer from the calibrated values, ignoring updates (True), or from the refined ones."""
        if pinned != self.pinned:
            self.pinned = pinned
            self._memo.clear()

    def cost(self, rows: int) -> np.ndarray:
        """t(1..rows) in seconds: [rows] float64."""
        memo = self._memo.get(rows)
        if memo is None:
            memo = self._memo[rows] = _interpolate(self.base if self.pinned else self.seconds, rows)
        return memo

    def shape(self, rows: int) -> float:
        """t(rows) / t(1) on the calibrated values: how many single steps a decode of `rows`
        rows is worth, whatever the load is now (the thread controller's yardstick)."""
        shape = self._shapes.get(rows)
        if shape is None:
            cost = _interpolate(self.base, rows)
            shape = self._shapes[rows] = float(cost[-1] / cost[0])
        return shape

    def largest(self) -> int:
        """The largest measured size (0 when none is)."""
        seen = np.flatnonzero(~np.isnan(self.seconds))
        return int(seen[-1]) + 1 if seen.size else 0

    def calibrate(self, timed_decode, max_rows: int, limit: int | None = None) -> None:
        """Measure t at the usual sizes and at `max_rows`, none above `limit` (the batch size).
        On a CPU the step from 1 to 2 rows is the steepest (a matrix-vector kernel gives way to
        a matrix-matrix one), so the small sizes are all measured. `timed_decode(n)` decodes n
        rows, rolls them back and returns the seconds taken; the best of two tries counts."""
        sizes = sorted(s for s in set(CALIBRATION_SIZES) | {max_rows} if limit is None or s <= limit)
        best = {}
        for rows in sizes + sizes:
            t = timed_decode(rows)
            if not np.isnan(t):
                best[rows] = min(best.get(rows, t), t)
        if len(best) < 2:
            return
        values = np.full(max(best), np.nan)
        for rows, t in best.items():
            values[rows - 1] = t
        self.seconds[:] = np.nan
        self._set(values)
        self.base = self.seconds.copy()
        self._shapes.clear()
        self.source, self.dirty = "measured", True

    def update(self, rows: int, seconds: float) -> None:
        """Fold in the measured time of a round that decoded `rows` rows."""
        if self.fixed or self.pinned or not seconds > 0:
            return
        if rows > len(self.seconds):           # grows, keeping what is there
            self.seconds = np.concatenate([self.seconds, np.full(rows - len(self.seconds), np.nan)])
        old = self.seconds[rows - 1]
        self.seconds[rows - 1] = seconds if np.isnan(old) else (1 - COST_EMA) * old + COST_EMA * seconds
        self._memo.clear()
        self.dirty = True

    # ---- the disk cache
    def _path(self) -> Path | None:
        if self.key is None:
            return None
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:20]
        return costs_dir() / f"{digest}.json"

    def load(self) -> bool:
        """Read the cached curve for this key, if there is a valid one."""
        path = self._path()
        try:
            data = json.loads(path.read_text()) if path else None
        except (OSError, ValueError):
            return False
        if (not isinstance(data, dict) or data.get("format") != COST_FORMAT or data.get("key") != self.key
                or not isinstance(data.get("seconds"), list)):
            return False
        arrays = []
        for field in ("seconds", "base"):
            raw = data.get(field, data["seconds"])           # a cache from before "base": its seconds
            try:
                values = np.array([np.nan if v is None else float(v) for v in raw], dtype=np.float64)
            except (TypeError, ValueError):
                return False
            if not np.isfinite(values[~np.isnan(values)]).all() or (values[~np.isnan(values)] <= 0).any():
                return False
            arrays.append(values)
        self._set(arrays[0])
        if not self.calibrated:
            return False
        base = np.full(len(self.seconds), np.nan)
        base[: min(len(base), len(arrays[1]))] = arrays[1][: len(base)]
        self.base = base
        self._shapes.clear()
        self.source, self.dirty = "cache", False
        return True

    def save(self) -> None:
        """Write the curve to the disk cache (atomically; a cache that cannot be written only
        means measuring again next time)."""
        path = self._path()
        if path is None or not self.calibrated or self.fixed:
            return
        data = {"format": COST_FORMAT, "key": self.key, "measured": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "seconds": [None if np.isnan(v) else float(v) for v in self.seconds],
                "base": [None if np.isnan(v) else float(v) for v in self.base]}
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".costs-", suffix=".part")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, path)
            tmp = None
            self.dirty = False
        except OSError:
            pass
        finally:                      # an error or a Ctrl-C leaves no temporary file behind
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def ensure(self, timed_decode, max_rows: int, limit: int | None = None, recalibrate: bool = False) -> None:
        """Make the curve usable up to `max_rows`: from the disk cache when it holds this key
        (unless `recalibrate`), else measured now and cached. Within a process a curve is
        measured at most once for each larger `max_rows` asked for."""
        if self.fixed or max_rows <= self._ensured:
            return
        if self.source == "none" and not recalibrate:
            self.load()
        if not (self.calibrated and self.largest() >= min(max_rows, limit or max_rows)):
            kept = self.base.copy() if self.calibrated and not recalibrate else None
            self.calibrate(timed_decode, max_rows, limit)
            if kept is not None:       # a larger size was asked for: the calibration so far stands
                n = min(len(kept), len(self.base))
                self.base[:n] = np.where(np.isnan(kept[:n]), self.base[:n], kept[:n])
                self._shapes.clear()
            self.save()
        self._ensured = max_rows


class DraftLength:
    def __init__(self, k_max: int, prior: np.ndarray, curve: CostCurve | None = None):
        """prior [levels] float64: the drafter's prior per-position acceptance by level.
        `curve`: the target's cost curve (shared; a private one when None)."""
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
        self.curve = curve if curve is not None else CostCurve()

    @property
    def calibrated(self) -> bool:
        return self.curve.calibrated

    def calibrate(self, timed_decode) -> None:
        """Measure the cost curve now (see CostCurve.calibrate)."""
        self.curve.calibrate(timed_decode, self.k_max + 1)

    def rates(self, level: int, available: int) -> np.ndarray:
        """Expected committed tokens per second for verifying 0..k of the `available` proposed
        tokens: [k+1] float64."""
        k = max(min(available, self.k_max), 0)
        row = level + self.levels * self.streak
        alpha = self.hits[row, :k] / self.tries[row, :k]
        expected = 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(alpha))])   # [k+1]: E(0..k)
        return expected / self.curve.cost(k + 1)

    def choose(self, level: int, available: int) -> int:
        """How many of `available` proposed tokens to verify this round. Acceptance is measured
        as committed, so a loose verifier's extra acceptance on long drafts counts in favour
        of long drafts."""
        if min(available, self.k_max) <= 0:
            return 0
        return int(np.argmax(self.rates(level, available)))

    def update(self, level: int, k: int, accepted: int, seconds: float | None = None) -> None:
        """Record a round that verified k tokens and accepted `accepted` of them, and (when
        given) its `seconds`, into the cost curve."""
        self.hits = self._prior_hits + DECAY * (self.hits - self._prior_hits)
        self.tries = PRIOR_WEIGHT + DECAY * (self.tries - PRIOR_WEIGHT)
        if k > 0:
            row = level + self.levels * self.streak
            reached = min(accepted + 1, k)          # positions that were actually decided
            self.tries[row, :reached] += 1.0
            self.hits[row, :accepted] += 1.0
        self.streak = k > 0 and accepted >= k
        if seconds is not None:
            self.curve.update(k + 1, seconds)


def timed_decode(runtime, token: int, rows: int) -> float:
    """Seconds for one decode of `rows` copies of `token` with logits on every row, rolled back
    after: a calibration probe for CostCurve. NaN when the context has no room."""
    n_past = runtime.n_past
    if n_past + rows > runtime.n_ctx:
        return float("nan")
    # Measured at the thread count the curve is keyed by, whatever --threads auto chose now.
    with getattr(runtime, "steady_threads", contextlib.nullcontext)():
        t0 = time.perf_counter()
        logits = runtime.decode(np.full(rows, token, dtype=np.int32), logits_from=0)
        logits.argmax(axis=1)
        runtime.truncate(n_past)
        return time.perf_counter() - t0


# Confidence levels of a draft model's token: buckets of its own top-1 probability.
P_EDGES = np.array([0.3, 0.5, 0.7, 0.85, 0.95])                  # level = searchsorted(P_EDGES, p)
P_PRIOR = np.array([0.15, 0.4, 0.6, 0.78, 0.9, 0.97])            # prior acceptance per level


def top_probability(logits: np.ndarray) -> np.ndarray:
    """The softmax probability of each row's argmax: [rows] float64 from logits [rows, V]."""
    z = logits - logits.max(axis=1, keepdims=True)
    return 1.0 / np.exp(z, dtype=np.float64).sum(axis=1)


class ModelDraftLength:
    """Whether a draft model drafts this round, and for how long (docs/design.md, "Cost model").

    A draft model spends c seconds per drafted token before the target sees anything, so

        rate(k) = E(k) / (k*c + t(k+1))

    with t the target's cost curve and acceptance measured per confidence level (the draft's
    own top-1 probability, bucketed). Before a round, `best` gives the rate the model is
    expected to reach, to be weighed against prompt lookup alone and a plain step. While
    drafting, `keep_going` keeps each further token only while it is expected to raise the
    round's rate, and a token the draft gives less than `p_min` ends the draft. On a CPU where
    the draft costs as much as a target step it never pays, and rounds fall back to lookup or
    plain steps; on a flat (GPU-like) curve with a cheap draft it drafts long."""

    def __init__(self, k_max: int, target: CostCurve, draft: CostCurve, p_min: float = 0.0):
        self.k_max = k_max
        self.target = target
        self.draft = draft
        self.p_min = p_min
        self.hits = P_PRIOR * PRIOR_WEIGHT          # [levels]
        self.tries = np.full(len(P_PRIOR), PRIOR_WEIGHT)
        self.all_hits, self.all_tries = 0.6 * PRIOR_WEIGHT, PRIOR_WEIGHT   # any level, for planning
        self._step_s = float("nan")                 # measured seconds per drafted token (EMA)

    @staticmethod
    def level(p: float) -> int:
        return int(np.searchsorted(P_EDGES, p))

    def step_s(self) -> float:
        """c: seconds per drafted token, measured (a fixed or pinned draft curve gives it as is)."""
        if self.draft.fixed or self.draft.pinned or np.isnan(self._step_s):
            return float(self.draft.cost(1)[0])
        return self._step_s

    def best(self, k: int) -> tuple[float, int]:
        """(expected tokens per second, draft length) of the best model draft of at most k
        tokens, at the mean measured acceptance; length 0 is a plain step."""
        k = min(k, self.k_max)
        a = self.all_hits / self.all_tries
        j = np.arange(k + 1)
        expected = (1 - a ** (j + 1)) / (1 - a) if a < 1 else j + 1.0
        rate = expected / (j * self.step_s() + self.target.cost(k + 1))
        best = int(np.argmax(rate))
        return float(rate[best]), best

    def keep_going(self, levels: list[int], p: float) -> bool:
        """Whether to keep the draft's next token (confidence `p`) after `levels` kept ones, and
        draft on: it must clear p_min and raise the round's expected rate."""
        if p < self.p_min:
            return False
        j = len(levels)
        if j == 0:
            return True
        alpha = self.hits[levels] / self.tries[levels]
        reach = np.cumprod(alpha)                                   # P(first i+1 accepted)
        a_next = self.hits[self.level(p)] / self.tries[self.level(p)]
        t, c = self.target.cost(j + 2), self.step_s()
        now = (1 + reach.sum()) / (j * c + t[j])
        more = (1 + reach.sum() + reach[-1] * a_next) / ((j + 1) * c + t[j + 1])
        return more > now

    def observe(self, levels, accepted: int, seconds: float | None = None) -> None:
        """Record a model draft with these per-token `levels`, of which `accepted` were
        committed, that took `seconds` of drafting."""
        self.hits = P_PRIOR * PRIOR_WEIGHT + DECAY * (self.hits - P_PRIOR * PRIOR_WEIGHT)
        self.tries = PRIOR_WEIGHT + DECAY * (self.tries - PRIOR_WEIGHT)
        k = len(levels)
        if k:
            reached = min(accepted + 1, k)
            np.add.at(self.tries, np.asarray(levels[:reached], dtype=np.intp), 1.0)
            np.add.at(self.hits, np.asarray(levels[:accepted], dtype=np.intp), 1.0)
            self.all_tries = PRIOR_WEIGHT + DECAY * (self.all_tries - PRIOR_WEIGHT) + reached
            self.all_hits = 0.6 * PRIOR_WEIGHT + DECAY * (self.all_hits - 0.6 * PRIOR_WEIGHT) + min(accepted, k)
            if seconds is not None and seconds > 0:
                per = seconds / k
                self._step_s = per if np.isnan(self._step_s) else (1 - COST_EMA) * self._step_s + COST_EMA * per
