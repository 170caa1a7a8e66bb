"""`--threads auto`: a context's CPU thread count chosen from how fast its decodes run now
(docs/operations.md, "Threads").

llama.cpp's CPU threads spin while they wait for each other, so on a busy desktop one thread
the OS deschedules stalls them all: with a busy loop on one of 2 cores, 2 threads ran at 0.61 of
the speed of 1 (18.9 against 31.0 tok/s, whole processes: docs/benchmarks.md). The best count depends on the load of the moment, so it is measured, the
way the draft-length controller measures acceptance:

- each decode's seconds, divided by the cost curve's shape for its row count (t(rows)/t(1)),
  give the seconds of a single-row step at the current count; the median of the last few is
  the current count's speed (one decode the OS stalled is not a change of load);
- now and then the other candidate counts are tried, nearest first, for a few decodes each (one,
  when it is clearly slower), and the fastest is kept if it beats the current one by a margin;
- a re-check comes early when the current count's speed changes (the load changed); otherwise
  it waits as long as keeps re-checks within BUDGET of decoding time, and twice as long after
  each re-check in a row that kept the count (between 1 and 8 seconds of decoding), so a count
  measured slow during a passing load is tried again within a generation, and probing costs
  next to nothing on a machine whose load stays as it is;
- counts above the cores other work leaves free are never used nor tried (`load`): the cores
  other processes kept busy (/proc/stat, flylocal.host.CpuLoad) over the last second or
  so of decoding, rounded, are taken off. On a core another runnable process shares, a thread
  that waits for its peers at each of a decode's hundreds of barriers waits a scheduler slice
  there: measured with two unpinned busy loops on 2 cores, a single-token decode on 2 threads
  took 16 ms most times, but 100-180 ms every few decodes, and up to 3 s in a process that
  started on 2 (1 thread: 12-24 ms). A median of a few decodes does not see that, and one trial
  can cost seconds, so the load decides which counts are worth trying at all.

What happened is kept (`report`): the decodes at each count and every move, with its reason.

Its time is the seconds of decoding observed (`decoded_s`), so the controller is deterministic given its
timings (tests feed it made-up ones).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from flylocal.host import QUIET, CpuLoad, costs_dir
from flylocal.statistics import middle

PROBES = 5              # decodes measured at a count being tried: their median counts
ABORT = 1.5             # a trial decode this much slower than the current count's median ends the trial
MARGIN = 0.3            # another count must be this much faster to move to it: a load that
                        # matters costs 2-4 times, and counts within 30% of each other are not
                        # worth a move that noise could undo
CHANGE = 1.4            # the current speed moved by this factor: the load changed, re-check now
RECHECK = (1.0, 8.0)    # seconds of decoding between re-checks, at least and at most
BUDGET = 0.015          # share of decoding time re-checks may lose: after one that cost c seconds
                        # more than the current count would have, the next waits c / BUDGET
                        # (a trial decode on a loaded core can cost ten ordinary ones)
RECENT = 5              # the current count's last decodes, compared with a trial's
KEEP = 600.0            # seconds a count settled on is worth starting the next process from:
                        # load outlives a process, not a long pause (and the next process checks)
PATIENCE = 120.0        # most seconds of decoding between re-checks when the last one was costly


def candidates(cores: int) -> list[int]:
    """The counts worth trying on `cores` cores: all of them, all but one (room for the
    desktop), and the powers of two below."""
    counts = {cores, max(cores - 1, 1)}
    p = 1
    while p < cores:
        counts.add(p)
        p *= 2
    return sorted(counts)


def free_cores(cores: int, busy: float | None) -> int:
    """The most threads worth running when other processes kept `busy` of `cores` cores busy
    (None: not known, all of them)."""
    if busy is None or not math.isfinite(busy):
        return cores
    return max(1, cores - int(math.floor(busy + 0.5)))


class ThreadControl:
    def __init__(self, counts: list[int], start: int | None = None, on_settle=None, why: str = "all cores"):
        """`start`: the count to begin on (default: the most), and `why` it was chosen;
        `on_settle(home)` is called each time a re-check ends (the count kept, moved to or not)."""
        self.on_settle = on_settle
        self.counts = sorted(set(counts))
        self.home = start if start in self.counts else self.counts[-1]   # the count in use
        self.current = self.home               # the count of the next decode (home, or one on trial)
        self.limit = self.counts[-1]           # the most threads the cores other work leaves free allow
        self.busy: float | None = None         # cores other processes kept busy, last measured
        self.displaced: int | None = None      # the count a load moved it from, until the load lifts
        self.used: dict[int, int] = {}         # count -> decodes observed at it
        self.log: list[dict] = [{"at_s": 0.0, "count": self.home, "why": why}]
        self.speed: dict[int, float] = {}      # count -> seconds of a single-row step, last measured
        self.recent: list[float] = []          # the home count's last RECENT steps
        self.reference: float | None = None    # their median when the home count was last confirmed
        self.decoded_s = 0.0                   # seconds of decoding observed
        self.next_check = 0.0
        self.trying: list[int] = []            # counts still to try in this re-check
        self.samples: list[float] = []         # the trial count's steps so far
        self.lost = 0.0                        # seconds this re-check's trials lost so far
        self.kept = 0                          # re-checks in a row that kept the count
        self.moves = 0

    def observe(self, step: float, seconds: float) -> int:
        """Fold in one decode: `step` the seconds it took divided by the cost-curve shape of
        its row count, `seconds` what it took. Returns the count for the next decode. A timing
        that is not a positive number (a clock that stood still) is ignored."""
        if not (step > 0 and math.isfinite(step) and seconds > 0 and math.isfinite(seconds)):
            return self.current
        self.decoded_s += seconds
        self.used[self.current] = self.used.get(self.current, 0) + 1
        if self.current != self.home:
            self.lost += max(seconds * (1 - self.speed[self.home] / step), 0.0)
            self._trial(step)
            return self.current
        self.recent = (self.recent + [step])[-RECENT:]
        if len(self.recent) < RECENT:
            return self.current
        now = self.speed[self.home] = middle(self.recent)     # a median: one stalled decode is no change
        if self.reference is None:
            self.reference = now
        changed = not (self.reference / CHANGE < now < self.reference * CHANGE)
        if changed:
            self.kept = 0
        allowed = self.allowed()
        if (changed or self.decoded_s >= self.next_check) and len(allowed) > 1:
            i = allowed.index(self.home)
            self.trying = sorted((c for c in allowed if c != self.home),
                                 key=lambda c: abs(allowed.index(c) - i))         # nearest first
            self.current = self.trying.pop(0)
            self.lost = 0.0
        return self.current

    def allowed(self) -> list[int]:
        """The counts worth using now: those the cores other work leaves free allow."""
        return [c for c in self.counts if c <= self.limit] or self.counts[:1]

    def load(self, busy: float | None) -> int:
        """Fold in how many cores other processes kept busy lately (None: unknown, no change).
        A count above what they leave free is dropped at once, a trial of one ends; when the
        load lifts, the count it moved from comes back at once (the move measured nothing), and
        the counts it allows are tried at the next decode. Returns the count for the next
        decode."""
        if busy is None or not math.isfinite(busy):
            return self.current
        self.busy = busy
        limit = free_cores(self.counts[-1], busy)
        if limit == self.limit:
            return self.current
        lifted, self.limit = limit > self.limit, limit
        if lifted:
            back = self.displaced
            if back is not None and back <= limit:
                self.displaced = None
            if back is not None and back <= limit and back != self.home:
                # The load moved it, which says nothing of which count is faster: back to where it was.
                self.trying, self.samples = [], []
                self._move(back, f"the load that moved it lifted ({busy:.1f} cores busy)")
                self.current = self.home
                return self.current
            self.next_check = self.decoded_s               # try what the load allows again
            return self.current
        if self.current > limit and self.current != self.home:        # a trial above it: ended
            self.trying, self.samples, self.current = [], [], self.home
        self.trying = [c for c in self.trying if c <= limit]
        if self.home > limit:
            self.trying, self.samples = [], []             # a re-check under way ends with the move
            self.displaced = self.displaced or self.home
            self._move(max(self.allowed()), f"other processes kept {busy:.1f} cores busy", settled=False)
            self.current = self.home
        return self.current

    def _move(self, count: int, why: str, settled: bool = True) -> None:
        """Make `count` the one in use; `settled`: a measurement chose it (a load's move measured
        nothing, and is no count for the next process to start from)."""
        self.home = count
        self.moves += 1
        self.kept = 0
        self.recent, self.reference = [], None
        self.next_check = self.decoded_s
        self.log.append({"at_s": round(self.decoded_s, 3), "count": count, "why": why})
        if settled and self.on_settle is not None:
            self.on_settle(count)

    def _trial(self, step: float) -> None:
        self.samples.append(step)
        if len(self.samples) < PROBES and step < ABORT * self.speed[self.home]:
            return
        self.speed[self.current] = middle(self.samples)
        self.samples = []
        if self.trying:
            self.current = self.trying.pop(0)
            return
        allowed = self.allowed()
        best = min((c for c in self.speed if c in allowed), key=self.speed.get)
        if self.speed[best] < (1 - MARGIN) * self.speed[self.home]:
            # moved: measure it, then look around again soon
            self.displaced = None
            self._move(best, f"measured faster: {1e3 * self.speed[best]:.1f} ms a step against "
                             f"{1e3 * self.speed[self.home]:.1f} at {self.home}")
            self.current = self.home
            return
        self.reference = self.speed[self.home]
        # A costly re-check waits until it is within BUDGET of the decoding time again, however
        # long (a trial on a shared core can cost seconds); a cheap one backs off up to RECHECK.
        wait = max(min(self.lost / BUDGET, PATIENCE), min(RECHECK[0] * 2 ** min(self.kept, 8), RECHECK[1]))
        self.next_check = self.decoded_s + wait
        self.kept += 1
        self.current = self.home
        if self.on_settle is not None:
            self.on_settle(self.home)

    def seed(self, speeds: dict[int, float]) -> int:
        """Start from a quick measurement of single steps at each count (before any prompt, in a
        process that knows nothing yet): the fastest becomes the count in use, and the usual
        re-check still follows within the first decodes. Returns it."""
        speeds = {c: s for c, s in speeds.items() if c in self.allowed() and s > 0 and math.isfinite(s)}
        if not speeds:
            return self.current
        self.speed.update(speeds)
        self.home = self.current = min(speeds, key=speeds.get)
        self.recent, self.reference, self.next_check = [], None, self.decoded_s
        self.log.append({"at_s": round(self.decoded_s, 3), "count": self.home,
                         "why": "measured fastest before the first prompt: "
                                + ", ".join(f"{c}: {1e3 * s:.1f} ms" for c, s in sorted(speeds.items()))})
        if self.on_settle is not None:
            self.on_settle(self.home)
        return self.home

    def report(self) -> dict:
        """What the run used: the count now, decodes at each count, other processes' load last
        measured (cores), and each move with its reason (`at_s`: seconds of decoding before it)."""
        return {"count": self.home, "decodes": {str(c): n for c, n in sorted(self.used.items())},
                "busy_cores": None if self.busy is None else round(self.busy, 2), "moves": list(self.log)}

    def rates(self) -> dict[int, float]:
        """Single-row steps per second last measured at each count tried."""
        return {c: 1.0 / s for c, s in sorted(self.speed.items()) if s > 0}


# ---- what the last process settled on, kept on disk (the cost curves' folder)

def _known_path() -> Path:
    return costs_dir() / "threads.json"


def _cores_key() -> str:
    try:
        return ",".join(map(str, sorted(os.sched_getaffinity(0))))
    except (AttributeError, OSError):
        return str(os.cpu_count() or 1)


def known_record() -> tuple[int, float] | None:
    """(count, when: seconds since the epoch) the last process on these cores settled on,
    however long ago; None when nothing readable is kept."""
    try:
        record = json.loads(_known_path().read_text()).get(_cores_key())
        return int(record["count"]), float(record["at"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def known_count(counts: list[int], clock=time.time) -> int | None:
    """The count the last process on these cores settled on, if that was within KEEP seconds
    and it is one of `counts`; None otherwise (nothing kept, too old, unreadable)."""
    record = known_record()
    if record is None:
        return None
    count, at = record
    return count if count in counts and 0 <= clock() - at <= KEEP else None


def keep_count(count: int, clock=time.time) -> None:
    """Record the count settled on now, for the next process (written whole, then renamed:
    concurrent processes never leave a torn file; the last one wins)."""
    path = _known_path()
    try:
        try:
            records = json.loads(path.read_text())
            records = records if isinstance(records, dict) else {}
        except (OSError, ValueError):
            records = {}
        records[_cores_key()] = {"count": int(count), "at": clock()}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(records))
        os.replace(tmp, path)
    except OSError:
        pass                      # a read-only cache: the next process measures for itself


def auto(threads: int, load: CpuLoad | None = None) -> tuple[ThreadControl, bool, CpuLoad]:
    """--threads auto on `threads` cores: the controller, starting from the count the last
    process on these cores settled on when that was recent, else on every core; whether it needs
    no probe (a recent count, or one count to choose from); and the meter of other processes'
    load (`load`, or one started now)."""
    counts = candidates(threads)
    known = known_count(counts)
    control = ThreadControl(counts, known or threads, why="the last process's count" if known else "all cores")

    def keep(count: int) -> None:
        # A count settled on while other work kept the cores busy is no start for a process on
        # an idle machine: only one measured quiet is kept.
        if control.busy is None or control.busy <= QUIET:
            keep_count(count)

    control.on_settle = keep
    if load is None:
        load = CpuLoad()
        load.start()                   # the first prompt's tokenizing gives it time
    return control, known is not None or len(counts) < 2, load
