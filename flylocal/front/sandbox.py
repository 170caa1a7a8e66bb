"""Running model-written programs (HumanEval completions) with some care.

Each program runs in a fresh `python -I` (isolated mode) in a new temporary directory that is
also its HOME and TMPDIR, with a minimal environment, no stdin, in a new session, under
resource limits (CPU seconds, address space, file size, process count, no core files). When it
ends, by itself or at the timeout, every process still in its session (or working inside its
directory) is killed, and the directory is removed.

This keeps an honest mistake from writing into the user's files or leaving processes behind.
It is not a security boundary: the program runs as the same user, with the network, and can
read and write any absolute path that user can; a container is the tool for untrusted code.
The kernel does not enforce the process limit for root, which is why what is left is found by
session (and directory) in /proc rather than trusted to the limit and the process group; a
process that leaves both the session and the directory escapes. The /proc scan is Linux-only
and skipped elsewhere.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ADDRESS_SPACE = 1 << 30        # bytes of virtual memory
FILE_SIZE = 16 << 20           # bytes any one file (and the captured output) may grow to
EXTRA_PROCESSES = 32           # processes the program may add to those its user already runs (RLIMIT_NPROC
                               # counts the user's threads, and root is exempt from it)
OUTPUT_LIMIT = 64 << 10        # bytes of stdout/stderr kept
SAFE_PATH = "/usr/bin:/bin"


@dataclass
class Outcome:
    returncode: int | None     # None: killed at the timeout
    output: str                # stdout and stderr together, at most OUTPUT_LIMIT bytes
    timed_out: bool

    @property
    def ok(self) -> bool:
        return not self.timed_out and self.returncode == 0


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


def _remove(root: str) -> None:
    """Remove `root` even where the program took away permissions inside it."""
    def fix(func, path, _exc):
        try:
            os.chmod(os.path.dirname(path), stat.S_IRWXU)
            if os.path.isdir(path) and not os.path.islink(path):
                os.chmod(path, stat.S_IRWXU)
            func(path)
        except OSError:
            pass

    if sys.version_info >= (3, 12):
        shutil.rmtree(root, onexc=fix)
    else:
        shutil.rmtree(root, onerror=fix)


def run_python(program: str, timeout: float) -> Outcome:
    """Run `program` (Python source) in the sandbox; see the module docstring."""
    root = os.path.realpath(tempfile.mkdtemp(prefix="flylocal-exec-"))
    try:
        path = Path(root, "program.py")
        path.write_text(program, encoding="utf-8")
        env = {"HOME": root, "TMPDIR": root, "PATH": SAFE_PATH, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
               "FLYLOCAL_SANDBOX": root}     # a program can check that it runs here (bench's code task does)
        nproc = _user_tasks(os.getuid()) + EXTRA_PROCESSES
        log = open(Path(root, ".output"), "w+b")
        try:
            limits = [math.ceil(timeout) + 1, ADDRESS_SPACE, FILE_SIZE, nproc, 0]
            proc = subprocess.Popen([sys.executable, "-I", "-c", BOOTSTRAP, str(path), *map(str, limits)], cwd=root,
                                    env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, close_fds=True)
            sid = proc.pid
            try:
                code = proc.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                code, timed_out = None, True
            finally:
                _kill_all(sid, root)
                proc.wait()
            log.seek(0)
            output = log.read(OUTPUT_LIMIT).decode("utf-8", "replace")
        finally:
            log.close()
        return Outcome(code, output, timed_out)
    finally:
        _remove(root)
