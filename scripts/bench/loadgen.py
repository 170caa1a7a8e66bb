"""Busy loops for benchmarks that measure flylocal on a loaded machine: one process per core,
pinned to it, spinning until a deadline (and killed when the `busy` block ends, or when the
script that started them is stopped)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time

LOAD_LIMIT_S = 900        # a busy loop ends by itself after this, whatever happens to its parent

SPIN = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    pass
"""


@contextlib.contextmanager
def busy(cores: list[int]):
    """Busy loops pinned to `cores`, bounded in time, ended on leaving."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN, str(c), str(LOAD_LIMIT_S)]) for c in cores]
    try:
        time.sleep(0.5 if procs else 0)
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
