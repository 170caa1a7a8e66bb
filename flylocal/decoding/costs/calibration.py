"""Calibrating a cost curve: a decode of each usual size timed in passes until the two lowest
times of each agree (docs/design.md, "Cost model"). A stall only ever adds time, so the lowest
counts. A calibration spends at most BUDGET seconds decoding: one that runs out keeps what it
has measured. The result is settled when the passes agreed, the shape obeys physics, other work
kept the cores quiet meanwhile and the single step is not SLOWER than the rounds just before
it; otherwise it is provisional: used, never saved, measured again later."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from flylocal import host
from flylocal.decoding.costs.shape import PRIOR_ROW_COST, SWITCH_MAX, distortion
from flylocal.statistics import middle
from flylocal.host import usable_cores

CALIBRATION_SIZES = (1, 2, 3, 5, 9, 17)
MIN_PASSES, MAX_PASSES = 3, 8
AGREE = 0.30             # the two lowest samples of a size within 30% (or ABS_AGREE seconds): a
                         # busy spell stalls decodes by 2-100x; on an idle 2-core VM a decode's
                         # time varies by 10-15%, and the two lowest of 8 by up to 27% at times
ABS_AGREE = 2e-4
SLOWER = 1.5             # a calibrated single step this much slower than the rounds before it: loaded
BUDGET = 5.0             # seconds of decoding a calibration may spend: on an idle 2-core machine it
                         # takes 1-1.5 s, and beside busy loops on both cores its stalled decodes
                         # took 96 s over 8 passes (2026-12-03)


@dataclass(frozen=True)
class Calibration:
    seconds: np.ndarray      # [m] t(1..m), NaN where not measured
    meta: dict               # when, in how many passes, how spread, under what load; the row switch's cost
    problem: str | None      # why it is provisional; None: settled


class Measuring:
    """A calibration that may be run in slices (`run`), each as many decodes as a slice's
    seconds allow, so that no request waits for all of it: `done` once its passes agreed, ran
    MAX_PASSES or spent `budget`; `result` then (or at any point) says what it measured."""

    def __init__(self, max_rows: int, limit: int | None = None, meter=None, budget: float = BUDGET):
        self.sizes = sorted(s for s in set(CALIBRATION_SIZES) | {max_rows} if limit is None or s <= limit)
        self.meter = meter if meter is not None else host.CpuLoad()
        self.budget = budget
        self.samples: dict[int, list[float]] = {rows: [] for rows in self.sizes}
        self.back: list[float] = []         # single steps right after a larger decode
        self.steady: list[float] = []       # single steps right after a single step
        # A pass: 1, 2, 1, 1, 3, 1, 1, ...: each size after a single step, as a draft's round comes;
        # after it a single step, which pays for changing the row count back, and another.
        self.schedule = []
        for rows in self.sizes:
            self.schedule.append((self.samples[rows], rows))
            if rows > 1 and self.sizes[0] == 1:
                self.schedule += [(self.back, 1), (self.steady, 1)]
        self.spent = 0.0                    # seconds of decodes so far
        self.passes = 0
        self.at = 0                         # the next decode's place in the pass (0: a new pass)
        self.started = False
        self.first = math.nan               # the first decode's seconds (pages and buffers included)
        self.done = False
        self.busy: float | None = None

    def out_of_time(self) -> bool:
        return self.spent >= self.budget and sum(1 for v in self.samples.values() if v) >= 2

    def run(self, timed_decode, seconds: float = math.inf, clock=time.perf_counter) -> bool:
        """Go on measuring (`timed_decode(n)` decodes n rows, rolls them back and returns the
        seconds taken) until done or until this slice would take more than `seconds` of wall
        time from its first decode (what a probe does before it, such as the prompt's prefill,
        is not the slice's): a decode that is expected to overrun it (at its size's lowest time
        so far, or the single step's on the prior's shape) is left to the next slice, unless it
        would be the slice's first. Whether it is done."""
        began: list[float] = []

        def timed(rows: int) -> float:
            t0 = clock()
            t = timed_decode(rows)
            if not began:       # the slice starts with the decode, not with what the probe did first
                began.append(clock() - t if t > 0 and math.isfinite(t) else t0)
            if t > 0 and math.isfinite(t):
                self.spent += t
                return t
            return math.nan

        if not self.started:
            self.started = True
            self.first = timed(self.sizes[0])    # the first decode pays for pages and buffers
            self.meter.start()
        while not self.done:
            if self.at == 0 and (self.passes >= MIN_PASSES and all(_agree(v) for v in self.samples.values())
                                 or self.passes >= MAX_PASSES or self.out_of_time()):
                self.done = True
                break
            into, rows = self.schedule[self.at]
            if began and clock() - began[0] + self._expected(rows) > seconds:
                return False
            if self.at == 0:
                self.passes += 1
            self.at = (self.at + 1) % len(self.schedule)
            if self.out_of_time():
                self.at = 0
                continue
            t = timed(rows)
            if not math.isnan(t):
                into.append(t)
        self.busy = self.meter.stop()
        return True

    def _expected(self, rows: int) -> float:
        """Seconds a decode of `rows` rows is expected to take: the lowest measured, else the
        single step's (or the first decode's) on the prior's shape; 0 before anything is timed."""
        if self.samples.get(rows):
            return min(self.samples[rows])
        one = min(self.samples[self.sizes[0]]) if self.samples[self.sizes[0]] else self.first
        return one * (1 + PRIOR_ROW_COST * (rows - self.sizes[0])) if math.isfinite(one) else 0.0

    def seconds(self) -> np.ndarray | None:
        """The lowest time of each size measured ([m], NaN where none), None with fewer than two."""
        best = {rows: min(v) for rows, v in self.samples.items() if v}
        if len(best) < 2:
            return None
        values = np.full(max(best), np.nan)
        for rows, t in best.items():
            values[rows - 1] = t
        return values

    def result(self, anchor: float | None = None) -> Calibration | None:
        """The calibration measured (see `calibrate`); None with fewer than two sizes."""
        samples, sizes, passes, spent, budget = self.samples, self.sizes, self.passes, self.spent, self.budget
        values = self.seconds()
        if values is None:
            return None
        best0 = values[sizes[0] - 1]
        spread = max((sorted(v)[1] / sorted(v)[0] - 1 for v in samples.values() if len(v) >= 2), default=None)
        problem = distortion(values)
        if not all(_agree(v) for v in samples.values()):
            disagree = f"passes disagree by up to {spread:.0%}" if any(
                len(v) >= 2 and not _agree(v) for v in samples.values()) else ""
            if self.out_of_time():
                problem = problem or (f"out of time after {passes} passes ({spent:.1f} s of decodes, at most "
                                      f"{budget:g} s)" + (f"; {disagree}" if disagree else ""))
            else:
                problem = problem or disagree or "a size was measured fewer than twice"
        busy = self.busy
        if busy is not None and busy > host.QUIET:
            problem = problem or f"{busy:.2f} cores were busy with other work"
        if anchor is not None and best0 > SLOWER * anchor:
            problem = problem or f"a single step took {best0 / anchor:.1f}x the rounds' just before"
        # Medians of as many samples each: the lowest of many is lower than the lowest of few. A
        # switch no single-row decode can cost is a stall, not llama.cpp's graph being built again.
        back, steady = self.back, self.steady
        switch = max(middle(back) - middle(steady), 0.0) if back and steady else None
        if switch is not None and switch > SWITCH_MAX * values[0]:
            switch = None
        meta = {"measured": time.strftime("%Y-%m-%dT%H:%M:%S"), "passes": passes,
                **({"switch": switch} if switch is not None else {}),
                **({"spread": round(float(spread), 4)} if spread is not None else {}),
                "busy_cores": None if busy is None else round(busy, 3), "cores": usable_cores()}
        return Calibration(values, meta, problem)


def calibrate(timed_decode, max_rows: int, limit: int | None = None, meter=None,
              anchor: float | None = None, budget: float = BUDGET) -> Calibration | None:
    """Measure t at the usual sizes and at `max_rows`, none above `limit` (the batch size), in
    one go. On a CPU the step from 1 to 2 rows is the steepest (a matrix-vector kernel gives way
    to a matrix-matrix one), so the small sizes are all measured. `timed_decode(n)` decodes n
    rows, rolls them back and returns the seconds taken. `anchor`: the seconds of the single-row
    rounds just before, when there were any. Once the decodes have taken `budget` seconds no
    other starts (but for the two sizes a curve needs): what was measured is kept, provisional
    unless its passes agreed. None when fewer than two sizes could be timed."""
    measuring = Measuring(max_rows, limit, meter, budget)
    measuring.run(timed_decode)
    return measuring.result(anchor)


def _agree(values: list[float]) -> bool:
    if len(values) < 2:
        return False
    a, b = sorted(values)[:2]
    return b <= a * (1 + AGREE) or b - a <= ABS_AGREE
