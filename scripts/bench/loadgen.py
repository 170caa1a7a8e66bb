"""Busy loops for benchmarks that measure flylocal on a loaded machine: one process per core,
pinned to it (`busy`), or processes the scheduler may move between cores (`unpinned`),
spinning until a deadline (and killed when the block ends, or when the script that started
them is stopped)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time

LOAD_LIMIT_S = 900        # a busy loop ends by itself after this, whatever happens to its parent

SPIN = """
import os, sys, time
if int(sys.argv[1]) >= 0:
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


@contextlib.contextmanager
def unpinned(n: int):
    """`n` busy loops the scheduler may move between cores, bounded in time, ended on leaving."""
    with busy([-1] * n):
        yield


@contextlib.contextmanager
def command(argv: list[str]):
    """A real neighbour: `argv` run over and over until the block ends (then killed)."""
    loop = subprocess.Popen([sys.executable, "-c", RERUN, str(LOAD_LIMIT_S), *argv],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        time.sleep(1.0)
        yield
    finally:
        import os
        import signal
        try:
            os.killpg(loop.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        loop.wait()


RERUN = """
import subprocess, sys, time
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    subprocess.run(sys.argv[2:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=end - time.monotonic())
"""


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description="Busy loops for benchmarks that measure flylocal on a loaded machine.",
                            epilog="A module costs.py and threads.py import; run by itself it does nothing.").parse_args()
