"""What a decode of n rows costs on one loaded model (docs/design.md, "Cost model").

    t(n) = shape(n) * speed        (after a long context, plus its share: costs/context.py)

- `shape(n) = t(n) / t(1)`, a property of the model, the build and the device, is calibrated
  once per key (model file, build, device, threads, batch size) from measurements that agree on
  a quiet machine (costs/calibration.py), and cached on disk (costs/store.py).
- `speed`, the seconds of a single-row step now, follows the load of the moment: the median of
  the last rounds, never saved.

Rounds refine the shape: a round of n rows over the single-row rounds just before it is a
sample of shape(n); one that breaks physics or lies FAR from a trusted calibration is a stall.
Fresh samples (3 within STALE seconds of decoding) correct the shape; older ones expire. Rounds
that contradict the curve beyond noise drop it, and it is measured again (costs/check.py).
Draft-length control may try a size whose evidence is stale (`explore`), losing at most EXPLORE
of the decoding time observed: a wrong curve is corrected within a generation.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from flylocal import host
from flylocal.decoding.costs import store
from flylocal.decoding.costs.calibration import BUDGET, CALIBRATION_SIZES, Measuring, calibrate
from flylocal.decoding.costs.check import STALE, Check
from flylocal.decoding.costs.context import LONG, ByContext
from flylocal.decoding.costs.shape import (FLOOR, PHYSICS, SWITCH_MAX, consistent, distortion, fill, interpolate,
                                           plausible, prior_shape)
from flylocal.statistics import middle

SWITCH_PRIOR = 0.07      # single steps the round after a draft pays to go back to one row, where
                         # a curve has no measurement of it: llama.cpp rebuilds its compute graph
                         # when a decode's row count changes (0.6 ms of a 9.1 ms step, 2 cores)
RETRY = 30.0             # wall seconds before a calibration taken under load is tried again (doubling),
RETRIES = 3              # at most 3 times per process: each costs a request ~1-2 s of waiting
WAIT = 0.1               # seconds of measuring a request waits for before its first token, where no
                         # curve is cached: the rest is measured in slices before the next ones

# Refinement from rounds.
RECENT = 7               # speed: the median of the last 7 rounds, each in single steps
ANCHORS = 5              # single-row rounds kept as the yardstick of a refinement sample
SAMPLES = 9              # refinement samples kept per size
FRESH = 3                # fresh samples needed before they correct the shape
EXPLORE = 0.015          # share of decoding time that trying stale sizes may lose


class State(str, enum.Enum):
    NONE = "none"                  # nothing known yet
    SETTLED = "settled"            # calibrated consistently on a quiet machine (and saved)
    PROVISIONAL = "provisional"    # measured under load or inconsistently: used, never saved, measured again
    REPAIRED = "repaired"          # the cached file was distorted (`problem` says how); measured again

    def __str__(self) -> str:
        return self.value


class Source(str, enum.Enum):
    NONE = "none"                  # nothing known yet
    CACHE = "cache"                # read from the disk cache
    MEASURED = "measured"          # calibrated in this process
    PRIOR = "prior"                # nothing measured yet: a cached curve of the same model at other
                                   # settings, or the prior's shape, in the speed the rounds measure
    GIVEN = "given"                # given by hand (tests, a fixed cost model)

    def __str__(self) -> str:
        return self.value


class CostCurve:
    """Seconds of one decode of n rows, all with logits, on one loaded model: t(n).

    `base` [m] holds the calibrated t(1..m), NaN where not measured; `meta` says when, in how
    many passes and under what load. `refined` [m] holds the saved refinement of the shape,
    NaN where none. `state` (State) says how far to trust it, `source` (Source) where it came
    from, `problem` why it is provisional or was repaired. A `fixed`
    curve never changes (tests, a cost model given by hand). A `pinned` curve answers from
    `base` alone, ignores rounds and never explores, so that decisions made on it do not depend
    on this run's timings (a seeded run). `say`, when set (by whoever shows the user notes), is
    told in one line what is measured and why, before a calibration the cache could not spare:
    none cached, the file unusable or absurd."""

    def __init__(self, key: dict | None = None, seconds=None, fixed: bool = False):
        self.key = key
        self.fixed = fixed
        self.pinned = False
        self._pins = 0                 # holders of a pin (`pin`)
        self.base = np.full(max(CALIBRATION_SIZES), np.nan)
        if seconds is not None:
            self._set_base(seconds)
        self.refined = np.full(len(self.base), np.nan)
        self.meta: dict = {}
        self.source = Source.GIVEN if seconds is not None else Source.NONE
        self.state = State.SETTLED if seconds is not None else State.NONE
        self.problem: str | None = None
        self.dirty = False
        self.say: Callable[[str], None] | None = None
        self.budget = BUDGET                                 # seconds of decoding a calibration may spend
        self._unusable: str | None = None                    # why the cache held no curve, at the last load
        self._ensured = 0
        self._retry_at = 0.0
        self._retry_wait = RETRY
        self._retries = 0
        self.measuring: Measuring | None = None              # a calibration going on in slices
        self.clock = time.perf_counter                       # the wall clock a slice is timed by
        self._sibling: dict | None = None                    # a cached curve of the same model to start from
        # This process's observations, timed by `decoded_s`: the seconds of rounds observed.
        self.decoded_s = 0.0
        self.recent: list[float] = []                        # the last rounds, in single steps
        self.anchors: list[tuple[float, float]] = []         # (decoded_s, seconds) of single-row rounds
        self.samples: dict[int, list[tuple[float, float]]] = {}   # rows -> (decoded_s, shape sample)
        # What may be saved: samples taken on the thread count the curve is keyed by (`on_key`,
        # kept by the runtime), in a period other work left the cores alone (`_period`).
        self.on_key = True
        self.keep: dict[int, list[float]] = {}
        self._period: host.CpuLoad | None = None
        self.check = Check()                                 # rounds on the keyed count, against the curve
        self.contradicted = 0                                # times the rounds contradicted it
        self._asked: tuple | None = None                     # (max_rows, limit, meter) of the last `ensure`
        self.rejected = 0                                    # round times dropped as stalls
        self.explored = 0                                    # rounds run at a stale size
        self.spent = 0.0                                     # seconds those rounds lost
        self._pending: float | None = None                   # an exploration's benchmark rate
        self._calibrated: np.ndarray | None = None           # memo: the calibrated shape
        self._step: float | None = None                      # memo: the calibrated single step
        self._shape: np.ndarray | None = None                # memo: the effective shape ...
        self._until = math.inf                               # ... until this decoded_s (evidence expires)
        self._speed: float | None = None                     # memo: the speed, until the next round
        self.cells = 0                                       # the context the rounds now follow (`at`)
        self.by_context = ByContext()                        # its share of a decode's cost (costs/context.py)

    def _set_base(self, seconds, whole: bool = False) -> None:
        """t(1..m) calibrated: `seconds` [m] over the first sizes, or the `whole` calibration."""
        seconds = np.asarray(seconds, dtype=np.float64)
        if whole:
            self.base = np.full(len(seconds), np.nan)
        if len(seconds) > len(self.base):
            self.base = np.concatenate([self.base, np.full(len(seconds) - len(self.base), np.nan)])
        self.base[: len(seconds)] = seconds
        self._changed()

    def _changed(self) -> None:
        """The calibration, the saved refinement or the pin changed: every memo goes."""
        self._calibrated = self._step = self._shape = self._speed = None

    @property
    def calibrated(self) -> bool:
        return int((~np.isnan(self.base)).sum()) >= 2

    def largest(self) -> int:
        """The largest calibrated size (0 when none is)."""
        seen = np.flatnonzero(~np.isnan(self.base))
        return int(seen[-1]) + 1 if seen.size else 0

    def calibrated_step(self) -> float:
        """The calibrated seconds of a single-row decode."""
        if self._step is None:
            self._step = float(interpolate(self.base, 1)[0])
        return self._step

    def pin(self, pinned: bool) -> None:
        """Answer from the calibrated values, ignoring rounds (True), or from shape and speed.
        Pins are counted: requests running together (flylocal.decoding.batch) each pin and
        unpin, and the curve stays pinned while any of them holds it."""
        self._pins = max(self._pins + (1 if pinned else -1), 0)
        if (self._pins > 0) != self.pinned:
            self.pinned = self._pins > 0
            self._changed()

    # ---- the curve as decisions see it
    def calibrated_shape(self, rows: int) -> np.ndarray:
        """t(1..rows) / t(1) as calibrated (the saved refinement included, unless pinned):
        [rows] float64, memoised (do not write into it)."""
        if self._calibrated is None or len(self._calibrated) < rows:
            size = max(rows, len(self.base), 33)
            cost = interpolate(self.base, size)
            shape = cost / cost[0]
            have = min(size, len(self.refined))
            if have and not self.pinned:
                saved = self.refined[:have]
                ok = ~np.isnan(saved)
                shape[:have][ok] = saved[ok]
            self._calibrated = shape
        return self._calibrated[:rows]

    def shape_of(self, rows: int) -> np.ndarray:
        """The effective shape t(1..rows) / t(1): the calibrated one, corrected by fresh
        evidence from rounds (interpolated in log between sizes with evidence, held past the
        largest). [rows] float64, memoised until a sample comes or one used expires."""
        if self._shape is not None and len(self._shape) >= rows and self.decoded_s <= self._until:
            return self._shape[:rows]
        size = max(rows, len(self.base), max(self.samples, default=0), 33)
        shape = self.calibrated_shape(size)
        self._until = math.inf
        if not (self.pinned or self.fixed):
            x, y = [1.0], [0.0]
            for n in sorted(self.samples):
                fresh = [r for c, r in self.samples[n] if self.decoded_s - c <= STALE]
                if len(fresh) >= FRESH:
                    x.append(float(n))
                    y.append(math.log(middle(fresh) / shape[n - 1]))
                    # kept until this size would have too few fresh samples (the median of
                    # the fresh ones, as they were at the last sample: one round's lag at most)
                    self._until = min(self._until, self.samples[n][-FRESH][0] + STALE)
            if len(x) > 1:
                shape = shape * np.exp(np.interp(np.arange(1, size + 1), x, y))
        self._shape = shape
        return shape[:rows]

    def shape(self, rows: int) -> float:
        """t(rows) / t(1): how many single steps a decode of `rows` rows is worth (the thread
        controller's yardstick)."""
        return float(self.shape_of(rows)[-1])

    def speed(self) -> float:
        """Seconds of a single-row step now: the median of the last rounds, each divided by its
        shape; the calibrated single step before any round (and for a pinned curve)."""
        if self._speed is None:
            use_rounds = not (self.pinned or self.fixed) and len(self.recent) >= 3
            self._speed = middle(self.recent) if use_rounds else self.calibrated_step()
        return self._speed

    def switch(self) -> float:
        """Single steps a single-row decode right after a larger one costs over a steady one:
        llama.cpp builds its compute graph again whenever the row count changes (a larger
        decode after single rows pays it too, and its calibration and samples include it)."""
        if self.fixed or self.source == Source.GIVEN:
            return 0.0
        measured = self.meta.get("switch")
        if not (isinstance(measured, (int, float)) and self.calibrated):
            return SWITCH_PRIOR
        steps = float(measured) / self.calibrated_step()
        return steps if 0 <= steps <= SWITCH_MAX else SWITCH_PRIOR      # beyond physics: a stall

    def at(self, cells: int) -> None:
        self.cells = cells          # the rounds from now on follow `cells` cached cells

    def cost(self, rows: int) -> np.ndarray:
        """Seconds of a round of 1..rows rows after `cells` cells: t(1..rows), with the step back
        to one row counted to the draft, and a long context's share (costs/context.py): [rows]."""
        frozen = self.pinned or self.fixed
        step = self.calibrated_step() if frozen else self.speed()
        out = (self.calibrated_shape(rows) if frozen else self.shape_of(rows)) * step
        if not frozen and (extra := self.by_context.extra(self.decoded_s, self.cells, rows)) is not None:
            out += extra * step
        out[1:] += self.switch() * step
        return out

    def evidence(self, rows: int) -> int:
        """How many fresh rounds of `rows` rows stand behind the shape there."""
        pairs = self.anchors if rows == 1 else self.samples.get(rows, ())
        return sum(1 for c, _ in pairs if self.decoded_s - c <= STALE)

    def _anchor(self) -> float | None:
        fresh = self._fresh(self.anchors)
        return middle(fresh) if fresh else None

    def _fresh(self, pairs) -> list[float]:
        return [s for c, s in pairs if self.decoded_s - c <= STALE]

    def trusted(self) -> bool:
        """Whether the curve is a settled calibration (cached or measured here) that the rounds
        have not contradicted: rounds far from it are stalls, not its shape."""
        return self.calibrated and self.state in (State.SETTLED, State.REPAIRED) and self.source in (
            Source.CACHE, Source.MEASURED) and self.measuring is None

    def _contradict(self, why: str) -> None:
        """The rounds contradict the curve beyond noise (a poisoned or foreign file, or one
        calibrated under a load that has gone): whatever its file says, it is no longer
        trusted. The rounds' samples correct its shape from now on, and it is measured again in
        slices before the next requests (or whole at `finish`), at most RETRIES times per
        process; a settled measurement then replaces the file."""
        self.contradicted += 1
        self.state, self.problem = State.PROVISIONAL, f"contradicted by the rounds: {why}; measured again"
        self.check.clear()
        self._changed()
        if self._asked is not None and self.contradicted <= RETRIES:
            self.measuring = Measuring(*self._asked, self.budget)

    # ---- rounds
    def update(self, rows: int, seconds: float, emitted: int | None = None) -> None:
        """Fold in a round that decoded `rows` rows in `seconds` and committed `emitted` tokens."""
        if self.fixed or self.pinned or not (seconds > 0 and math.isfinite(seconds)):
            self._pending = None
            return
        if self._pending is not None:          # an exploration: what it lost against the choice
            if emitted is not None:
                self.spent += max(seconds - emitted / self._pending, 0.0)
            self.explored += 1
            self._pending = None
        self.decoded_s += seconds
        self._speed = None
        if self._period is None and self.key is not None:
            self._period = host.CpuLoad()
            self._period.start()
        if self.cells >= LONG:      # the context's share; once it counts, never the shape's evidence
            self.by_context.update(self.decoded_s, self.cells, rows, seconds, shape := self.shape(rows))
            if (extra := self.by_context.extra(self.decoded_s, self.cells, rows)) is not None:
                self.recent = (self.recent + [seconds / (shape + extra[-1])])[-RECENT:]
                return
        calibrated = float(self.calibrated_shape(rows)[-1])
        if self.on_key and self.trusted() and (
                why := self.check.round(rows, seconds, calibrated, self.calibrated_step(), self.decoded_s)):
            self._contradict(why)
        if rows == 1:
            self.anchors = (self.anchors + [(self.decoded_s, seconds)])[-ANCHORS:]
        elif (anchor := self._anchor()) is not None:
            r = seconds / anchor
            # A sample beyond physics is a stall; one far from a trusted curve too (it counts
            # against the curve in costs/check.py); a curve no longer trusted takes what physics allows.
            if FLOOR <= r <= PHYSICS * rows and (plausible(rows, r, calibrated) or not self.trusted()):
                self.samples[rows] = (self.samples.get(rows, []) + [(self.decoded_s, r)])[-SAMPLES:]
                self._shape = None
                if self.on_key:
                    self.keep[rows] = (self.keep.get(rows, []) + [r])[-SAMPLES:]
                    self.dirty = True
            else:
                self.rejected += 1
        self.recent = (self.recent + [seconds / self.shape(rows)])[-RECENT:]

    def explore(self, rates: np.ndarray, best: int) -> int:
        """The draft length to verify this round: `best` (the argmax of `rates` [k+1], the
        expected tokens per second of verifying 0..k), or a length whose size has fewer than
        FRESH fresh rounds behind it, when what that round is expected to lose against `best`
        fits the exploration budget (the cheapest such length). A size's cost is never believed
        above what physics allows, so a curve that says a size is absurdly dear cannot keep it
        from being tried."""
        if self.fixed or self.pinned or len(rates) < 2 or not rates[best] > 0:
            return best
        step = self.speed()
        left = EXPLORE * self.decoded_s - self.spent
        if left < 0:
            return best
        cost = self.cost(len(rates))
        choice, least = best, left
        for j in range(len(rates)):
            if j == best or self.evidence(j + 1) >= FRESH:
                continue
            expected = rates[j] * cost[j]                        # tokens the round is expected to emit
            loss = min(cost[j], PHYSICS * (j + 1) * step) - expected / rates[best]
            if loss <= least:
                choice, least = j, loss
        if choice != best:
            self._pending = float(rates[best])
        return choice

    # ---- calibration and the disk cache
    def calibrate(self, timed_decode, max_rows: int, limit: int | None = None, meter=None) -> None:
        """Measure the curve now (flylocal.decoding.costs.calibration), spending at most `budget`
        seconds decoding: settled, or provisional when it was taken under load, disagreed, ran
        out of time or broke physics."""
        self._apply(calibrate(timed_decode, max_rows, limit, meter, anchor=self._anchor(), budget=self.budget))

    def _apply(self, done) -> None:
        """A calibration's result (None: nothing usable measured) becomes the curve."""
        if done is None:
            return
        self._set_base(done.seconds, whole=True)
        self.refined = np.full(len(self.base), np.nan)
        self._changed()
        self.meta = done.meta
        self.source = Source.MEASURED
        self.state, self.problem = (State.SETTLED, None) if done.problem is None else (State.PROVISIONAL, done.problem)
        self.dirty = self.state == State.SETTLED

    def ensure(self, timed_decode, max_rows: int, limit: int | None = None, recalibrate: bool = False,
               meter=None, wait: float | None = None) -> None:
        """Make the curve usable up to `max_rows`: from the disk cache when it holds this key
        (unless `recalibrate`), else measured and cached. Within a process a curve is measured
        at most once for each larger `max_rows` asked for. A provisional one is replaced by one
        another process has cached meanwhile, or else measured again once RETRY seconds have
        passed (then twice as long), at most RETRIES times.

        `wait`: the most seconds of measuring this call may spend (before a first token); the
        rest follows in slices, one each later call (or at `finish`), the curve provisional
        meanwhile. Where nothing is known, the first call measures nothing (`_start`). None:
        measured whole now."""
        if self.fixed:
            return
        self._asked = (max(max_rows, self._asked[0] if self._asked else 0), limit, meter)
        if self.measuring is not None:
            if recalibrate or self.measuring.sizes[-1] < min(max_rows, limit or max_rows):
                self.measuring = None                  # asked for again, or for larger sizes: measured anew
            else:
                self._measure(timed_decode, math.inf if wait is None else wait)     # None: the rest, whole
                return
        retry = (self.state == State.PROVISIONAL and self._retries < RETRIES
                 and time.monotonic() >= self._retry_at)
        if max_rows <= self._ensured and not retry:
            return
        if (self.source == Source.NONE or retry) and not recalibrate:
            before = self.state, self.problem
            loaded = self.load()
            if loaded and self.state != State.PROVISIONAL and self.largest() >= min(max_rows, limit or max_rows):
                self._ensured = max(max_rows, self._ensured)
                return
            if loaded and self.state == State.PROVISIONAL:   # a start, not an answer: measured again
                retry = True
            elif retry and self.state != State.SETTLED:      # nothing usable cached: still provisional
                self.state, self.problem = before
            retry = retry and self.state == State.PROVISIONAL
        if retry or not (self.calibrated and self.largest() >= min(max_rows, limit or max_rows)):
            keep = self.calibrated and not recalibrate and self.state != State.PROVISIONAL
            if wait is not None and not keep:
                if self.say is not None and self._unusable is not None and not retry:
                    self.say(f"measuring the decode cost of {self.name()} on this machine ({self._unusable}): "
                             f"in slices, never more than {wait:g} s before a first token")
                self._unusable = None
                self._retries += retry
                self.measuring = Measuring(max_rows, limit, meter, self.budget)
                if self.source == Source.NONE:         # nothing known: no decode before this first token
                    self._start()
                else:
                    self._measure(timed_decode, wait)
                self._ensured = max(max_rows, self._ensured)
                return
            kept, kept_meta = self.base.copy(), self.meta
            repaired = self.problem if self.state == State.REPAIRED else None
            if self.say is not None and self._unusable is not None and not (retry or keep):
                self.say(f"measuring the decode cost of {self.name()} on this machine ({self._unusable}): "
                         f"up to {self.budget:g} s")
            self._unusable = None
            self.calibrate(timed_decode, max_rows, limit, meter)
            # A larger size was asked for: the calibration so far stands, the new sizes join it.
            if keep and (merged := fill(kept, self.base, between=False)) is not None:
                self.base = merged
                self.meta = kept_meta | {"extended": self.meta.get("measured")}
                self._changed()
            if self.state == State.SETTLED:
                if repaired:
                    self.state, self.problem = State.REPAIRED, repaired
                self.save()
            else:
                self._settle_later(retry)
        self._ensured = max(max_rows, self._ensured)

    def _settle_later(self, retry: bool) -> None:
        """A measurement ended provisional: cached as such (so that the next process starts
        from it), measured again later."""
        self.save_provisional()
        self._retries += retry
        self._retry_at = time.monotonic() + self._retry_wait
        self._retry_wait *= 2

    def _start(self) -> None:
        """A curve nothing of which is measured yet, to decide on until slices measure it: a
        settled curve of the same model at other settings where the cache has one, else the
        prior's shape; either way the speed comes from the rounds once there are a few."""
        whence = "the prior's shape"
        if sibling := self.sibling():
            self._set_base(sibling["base"], whole=True)
            whence = "the curve at " + store.settings(sibling["key"])
        self.source, self.state = Source.PRIOR, State.PROVISIONAL
        self.problem = f"nothing measured yet: {whence}, in the rounds' speed, until it is measured in slices"

    def finish(self, timed_decode, seconds: float = math.inf) -> None:
        """Measure the rest of a calibration going on in slices now, whole (a process that will
        serve no other request, after its answer), and cache it as `ensure` would; or one more
        slice of at most `seconds` (a server's model as it unloads)."""
        if self.measuring is None:
            return
        self._measure(timed_decode, seconds)

    def _measure(self, timed_decode, wait: float) -> None:
        """A slice of the calibration going on: at most `wait` seconds of decodes (and the two
        sizes a curve needs). Done, its result is the curve's, as `calibrate` leaves it; not
        yet, the curve is what it has measured so far, provisional."""
        measuring = self.measuring
        if measuring.run(timed_decode, wait, self.clock):
            self.measuring = None
            self._apply(measuring.result(anchor=self._anchor()))
            if self.state == State.SETTLED:
                self.save()
            else:
                self._settle_later(False)
            return
        values = measuring.seconds()
        if values is None or distortion(values) is not None:
            return
        seen = ~np.isnan(values)          # one pass can time more rows cheaper: they never cost less
        values[seen] = np.maximum.accumulate(values[seen])
        if self.state != State.SETTLED or self.source != Source.CACHE:
            # The sizes not measured yet: a settled curve of the same model at another thread
            # count or batch size, in this machine's single step now, where the cache has one;
            # else the slope of the sizes measured (interpolate).
            start, whence = values, ""
            if (sibling := self.sibling()) and (filled := fill(values, sibling["base"])) is not None:
                start = filled
                whence = "; the sizes not yet measured from the curve at " + store.settings(sibling["key"])
            self._set_base(start, whole=True)
            self.refined = np.full(len(self.base), np.nan)
            self.meta = {"measured": time.strftime("%Y-%m-%dT%H:%M:%S"), "passes": measuring.passes}
            self.source = Source.MEASURED
            self.state = State.PROVISIONAL
            self.problem = (f"being measured, {measuring.spent:.2f} s of decodes so far, at most {WAIT:g} s before "
                            f"each request{whence}")

    def sibling(self) -> dict | None:
        """A settled curve of the same model at other settings (store.sibling), looked for once."""
        if self._sibling is None and self.key is not None:
            self._sibling = store.sibling(self.key) or {}
        return self._sibling or None

    def name(self) -> str:
        """The model's file name, without .gguf: what the curve is of, in a line to the user."""
        return Path(str((self.key or {}).get("model", "the model"))).stem

    def load(self) -> bool:
        """Read the cached curve for this key, if there is a valid one. A file whose
        calibration is distorted is not obeyed (the curve is measured again: `state` becomes
        REPAIRED once it is); what else is absurd in it (a refinement, the row switch's cost) is
        dropped and the file is rewritten without it."""
        if self.key is None:
            return False
        record, unusable = store.read(self.key)
        path = store.path_for(self.key)
        if record is None:
            self._unusable = (f"the cost cache at {path} {unusable}" if unusable else
                              f"no curve of it is cached in {path.parent} yet")
            return False
        base, refined, problem = record["base"], record["refined"], record["problem"]
        if record["calibration_problem"] is not None:
            self.state, self.problem = State.REPAIRED, f"cached calibration distorted: {record['calibration_problem']}"
            self._unusable = f"the cost cache at {path} holds an absurd curve: {record['calibration_problem']}"
            return False
        self._unusable = None
        self._set_base(base, whole=True)
        self.refined = np.full(len(self.base), np.nan)
        self.refined[: min(len(refined), len(self.base))] = refined[: len(self.base)]
        self._changed()
        self.meta = record["meta"]
        self.source = Source.CACHE
        self.state, self.problem = (State.REPAIRED, problem) if problem else (State.SETTLED, None)
        if self.meta.get("provisional"):      # the load kept it from settling: a start, measured again
            self.state, self.problem = State.PROVISIONAL, f"cached provisional: {self.meta['provisional']}"
        self.dirty = False
        if problem or record["format"] != store.COST_FORMAT:
            self._write()
        return True

    def _consistent_refinement(self) -> np.ndarray:
        """This process's refinement that may be saved: per size with SAVE_SAMPLES samples or
        more (taken on the keyed thread count) whose middle half agrees, their lower quartile;
        NaN elsewhere. Nothing when other work kept QUIET cores or more busy meanwhile. [m]
        float64."""
        busy = self._period.stop() if self._period is not None else None
        self._period = None
        if busy is not None and busy > host.QUIET:
            self.keep.clear()
        return consistent(self.keep, len(self.base))

    def save(self) -> None:
        """Write the curve to the disk cache, if it is settled (a cache that cannot be written
        only means measuring again next time)."""
        if self.key is None or not self.calibrated or self.fixed or self.state == State.PROVISIONAL:
            return
        new = self._consistent_refinement()
        if np.isnan(new).all() and self.source == Source.CACHE:
            return                                       # nothing new to write
        if len(new) > len(self.refined):
            self.refined = np.concatenate([self.refined, np.full(len(new) - len(self.refined), np.nan)])
        self.refined[: len(new)] = np.where(np.isnan(new), self.refined[: len(new)], new)
        self._changed()
        self._write()

    def save_provisional(self) -> None:
        """Cache a curve the load kept from settling, marked so (`meta["provisional"]`: why),
        unless the cache holds a settled one already (another process's, measured quietly)."""
        if self.key is None or not self.calibrated or self.fixed or self.state != State.PROVISIONAL \
                or distortion(self.base) is not None:        # nothing past physics is a start
            return
        record, _ = store.read(self.key)     # a settled one written after this read still stands:
        if record is not None and not record["meta"].get("provisional") and record["calibration_problem"] is None:
            return                           # the provisional file is another (store.write)
        why = (self.problem or "unsettled").removeprefix("cached provisional: ")
        store.write(self.key, self.meta | {"provisional": why[:200]}, self.base,
                    np.full(len(self.base), np.nan))

    def _write(self) -> None:
        if store.write(self.key, self.meta, self.base, self.refined):
            self.dirty = False

    def report(self) -> dict:
        """The curve's state, for `--json` stats and doctor."""
        rows, known = max(self.largest(), 1), self.calibrated
        shape = self.calibrated_shape(rows) if known else prior_shape(rows)
        return {"source": self.source.value, "state": self.state.value,
                "shape": {str(n): round(float(shape[n - 1]), 3) for n in CALIBRATION_SIZES if n <= rows},
                "calibrated_step_ms": round(1000 * self.calibrated_step(), 3) if known else None,
                "step_ms": round(1000 * self.speed(), 3) if known else None, "switch_steps": round(self.switch(), 3),
                **{k: self.meta[k] for k in ("measured", "passes", "spread", "busy_cores") if k in self.meta},
                "explored": self.explored, "rejected": self.rejected, "contradicted": self.contradicted,
                "explore_share": round(self.spent / self.decoded_s, 4) if self.decoded_s else 0.0,
                **({"problem": self.problem} if self.problem else {}), **self.by_context.report(self.decoded_s, self.cells)}
