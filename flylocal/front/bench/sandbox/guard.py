"""The guard (`bench --execute-unsafe`, where namespaces are not to be had): rlimits and a
session, not isolation (flylocal.front.bench.sandbox for what isolates).

The program runs in a fresh `python -I` (isolated mode) in its folder, which is also its HOME
and TMPDIR, with a minimal environment, no stdin, in a new session, under resource limits (CPU
seconds, address space, file size, process count, no core files). When it ends, by itself or at
the timeout, every process still in its session (or working inside its folder) is killed.

This keeps an honest mistake from writing into the user's files or leaving processes behind.
It is not a security boundary: the program runs as the same user, with the network, and can
read and write any absolute path that user can. The kernel does not enforce the process limit
for root, which is why what is left is found by session (and folder) in /proc rather than
trusted to the limit and the process group; a process that leaves both the session and the
folder escapes. The /proc scan is Linux-only and skipped elsewhere.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

EXTRA_PROCESSES = 32           # processes the program may add to those its user already runs (RLIMIT_NPROC
                               # counts the user's threads, and root is exempt from it)


def _user_tasks(uid: int) -> int:
    """Threads of all processes of user `uid` (what RLIMIT_NPROC counts), or a generous guess."""
    if not os.path.isdir("/proc"):
        return 1024
    count = 0
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and os.stat(f"/proc/{d}").st_uid == uid:
                count += len(os.listdir(f"/proc/{d}/task"))
        except OSError:
            continue
    return count


# Runs first in the new interpreter: set the limits, then exec the program with them. (Setting
# them in a preexec_fn would run Python between fork and exec in a process with native
# threads, such as llama.cpp's.)
BOOTSTRAP = """
import os, resource, sys
for name, value in zip(("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_NPROC", "RLIMIT_CORE"), sys.argv[2:]):
    which = getattr(resource, name, None)
    if which is not None:
        hard = resource.getrlimit(which)[1]
        value = int(value) if hard == resource.RLIM_INFINITY else min(int(value), hard)
        resource.setrlimit(which, (value, value))
os.execv(sys.executable, [sys.executable, "-I", sys.argv[1]])
"""


def _session_of(pid: str) -> int | None:
    """The session id of process `pid` from /proc/PID/stat (field 6), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2:].split()     # after "pid (comm) ": state ppid pgrp session ...
    try:
        return int(fields[3])
    except (IndexError, ValueError):
        return None


def _inside(pid: str, root: str) -> bool:
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return False
    return cwd == root or cwd.startswith(root + os.sep)


def stragglers(sid: int, root: str) -> list[int]:
    """Processes in session `sid`, or working inside `root`, other than this one."""
    if not os.path.isdir("/proc"):
        return []
    me = os.getpid()
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != me and (_session_of(d) == sid or _inside(d, root)):
            found.append(int(d))
    return found


def _kill_all(sid: int, root: str) -> None:
    """SIGKILL the process group (= session leader's pid) and anything left in the session or
    the directory; repeated while something new turns up (a fork racing the scan)."""
    try:
        os.killpg(sid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for _ in range(50):
        left = [p for p in stragglers(sid, root) if not _is_zombie(p)]
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.02)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return True
    return data[data.rfind(b")") + 2:][:1] in (b"Z", b"X")


def run(program: Path, work: str, env: dict, limits: list[int], timeout: float, log) -> tuple[int | None, bool]:
    """Run `program` in `work` under the guard; (its exit status, or None at the timeout;
    whether it timed out). Its output goes to the file `log`."""
    nproc = _user_tasks(os.getuid()) + EXTRA_PROCESSES
    limits = [*limits[:3], nproc, limits[4]]
    proc = subprocess.Popen([sys.executable, "-I", "-c", BOOTSTRAP, str(program), *map(str, limits)], cwd=work,
                            env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, close_fds=True)
    sid = proc.pid
    try:
        timed_out = wait_for(proc, timeout, lambda: _kill_all(sid, work))
    finally:
        _kill_all(sid, work)
        proc.wait()
    return (None if timed_out else proc.returncode), timed_out


def wait_for(proc: subprocess.Popen, timeout: float, kill) -> bool:
    """Wait for `proc` to end, calling `kill()` (from another thread) if it has not after
    `timeout` seconds; whether it had to. (Popen.wait with a timeout polls, up to 50 ms late,
    which is most of what a short program costs.)"""
    import threading

    fired = threading.Event()

    def expire():
        fired.set()
        kill()

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    try:
        proc.wait()
    except BaseException:                 # a Ctrl-C: nothing of the program outlives the caller's wait
        timer.cancel()
        kill()
        proc.wait()
        raise
    finally:
        timer.cancel()
    return fired.is_set()
