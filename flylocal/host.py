"""Facts of this machine every layer reads: the cores this process may run on, how busy other
work keeps them (`CpuLoad`: a calibration taken under load, or a refinement gathered under it,
is used but never saved; docs/design.md, "Cost model"), and where flylocal keeps what it
measured of the machine (the decode cost curves, flylocal.decoding.costs, and the thread count
--threads auto settled on, flylocal.llama.threads)."""

from __future__ import annotations

import contextlib
import os
import resource
import time
from pathlib import Path

QUIET = 0.25             # cores busy with other work above which a measurement was taken under load
MIN_WALL = 0.1           # seconds a load measurement needs


def usable_cores() -> int:
    """The cores this process may run on (its affinity), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def costs_dir() -> Path:
    """$FLYLOCAL_COSTS, or ~/.cache/flylocal/costs."""
    return Path(os.environ.get("FLYLOCAL_COSTS") or Path.home() / ".cache" / "flylocal" / "costs")


class CpuLoad:
    """Cores kept busy by other processes while a measurement runs: the CPU time /proc/stat
    counts on this process's cores, less this process's own, over the wall time. None where
    /proc/stat cannot be read (not Linux)."""

    def __init__(self):
        self._start = None

    @staticmethod
    def _read():
        try:
            cores = {f"cpu{c}" for c in os.sched_getaffinity(0)}
            busy = 0
            with open("/proc/stat") as f:
                for line in f:
                    parts = line.split()
                    if parts and parts[0] in cores:
                        v = [int(x) for x in parts[1:9]]
                        busy += sum(v) - v[3] - v[4]           # all but idle and iowait
            own = resource.getrusage(resource.RUSAGE_SELF)
            return time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), own.ru_utime + own.ru_stime
        except (OSError, ValueError, AttributeError, IndexError):
            return None

    @staticmethod
    def running_now() -> int | None:
        """Threads of other processes runnable at this instant: /proc/stat's procs_running,
        machine-wide, less this process's own (those in state R, the reader among them); None
        where it cannot be read. A busy loop is always runnable: this says whether a load is
        here now, where an average over a while says it was."""
        try:
            with open("/proc/stat") as f:
                running = next(int(line.split()[1]) for line in f if line.startswith("procs_running "))
            own = 0
            for task in os.listdir("/proc/self/task"):
                with contextlib.suppress(OSError):
                    with open(f"/proc/self/task/{task}/stat") as f:
                        own += f.read().rpartition(")")[2].split()[0] == "R"
            return max(running - max(own, 1), 0)
        except (OSError, ValueError, IndexError, StopIteration):
            return None

    def start(self) -> None:
        self._start = self._read()

    def elapsed(self) -> float | None:
        """Seconds since `start` (None: not started, or /proc/stat unreadable)."""
        return None if self._start is None else time.monotonic() - self._start[0]

    def stop(self) -> float | None:
        end = self._read()
        if self._start is None or end is None:
            return None
        wall = end[0] - self._start[0]
        if wall < MIN_WALL:               # /proc/stat counts in ticks of 10 ms: too short to tell
            return None
        return max((end[1] - self._start[1]) - (end[2] - self._start[2]), 0.0) / wall
