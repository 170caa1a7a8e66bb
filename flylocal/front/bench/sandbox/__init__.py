"""Running model-written programs (HumanEval completions, bench's code task): isolated by Linux
namespaces, or, where the machine allows none and the user says so, under the guard alone
(docs/operations.md, "Running model-written code").

    run_python(program, timeout, unsafe) -> a fresh folder flylocal-exec-*/work (the program's
        HOME, TMPDIR and working folder) -> jail.py (isolated: no network, a read-only root of
        its own but for its folder, its own PIDs, an unprivileged user, limits) or guard.py
        (rlimits and a session) -> Outcome -> the folder removed, never across a mount or
        through a link

`isolation()` says, once per process, why namespaces cannot be had here (None when they can):
`bench --execute` refuses in one line then, unless --execute-unsafe chooses the guard.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from flylocal.errors import FlylocalError
from flylocal.front.bench.sandbox import guard

ADDRESS_SPACE = 1 << 30        # bytes of virtual memory
FILE_SIZE = 16 << 20           # bytes any one file (and the captured output) may grow to
PROCESSES = 64                 # processes (threads) the program may run at once, in its namespace
OUTPUT_LIMIT = 64 << 10        # bytes of stdout/stderr kept
SAFE_PATH = "/usr/bin:/bin"
JAIL_ID = 2_000_000_000        # the outer uid and gid of the program's user where the caller is root: no file's
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache", "/etc/ld.so.conf",
          "/etc/ld.so.conf.d", "/etc/localtime")       # what the program sees of the machine, read-only
JAIL = Path(__file__).with_name("jail.py")
SETUP_S = 0.5                  # seconds a jail may take to be built, beyond the program's timeout


class SandboxError(FlylocalError):
    """The sandbox could not be built here (one line saying why)."""


@dataclass
class Outcome:
    returncode: int | None     # None: killed at the timeout; negative: killed by that signal
    output: str                # stdout and stderr together, at most OUTPUT_LIMIT bytes
    timed_out: bool

    @property
    def ok(self) -> bool:
        return not self.timed_out and self.returncode == 0


@dataclass(frozen=True)
class Sandbox:
    """How bench runs model-written code: isolated (the default), or under the guard alone
    (`unsafe`: --execute-unsafe)."""
    unsafe: bool = False

    def run(self, program: str, timeout: float) -> Outcome:
        return run_python(program, timeout, self.unsafe)

    @property
    def name(self) -> str:
        return "guard (unsafe)" if self.unsafe else "namespaces"


def run_python(program: str, timeout: float, unsafe: bool = False) -> Outcome:
    """Run `program` (Python source) in a fresh folder, isolated (`unsafe`: under the guard);
    SandboxError when the jail cannot be built."""
    base = os.path.realpath(tempfile.mkdtemp(prefix="flylocal-exec-"))
    try:
        work = os.path.join(base, "work")
        os.mkdir(work, 0o700)
        path = Path(work, "program.py")
        path.write_text(program, encoding="utf-8")
        env = {"HOME": work, "TMPDIR": work, "PATH": SAFE_PATH, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
               "FLYLOCAL_SANDBOX": work}     # a program can check that it runs here (bench's code task does)
        limits = [math.ceil(timeout) + 1, ADDRESS_SPACE, FILE_SIZE, PROCESSES, 0]
        with open(os.path.join(base, "output"), "w+b") as log:
            if unsafe:
                code, timed_out = guard.run(path, work, env, limits, timeout, log)
            else:
                code, timed_out = _jailed(base, work, path, env, limits, timeout, log)
            log.seek(0)
            output = log.read(OUTPUT_LIMIT).decode("utf-8", "replace")
        return Outcome(code, output, timed_out)
    finally:
        remove_tree(base)


def _jailed(base: str, work: str, program: Path, env: dict, limits: list[int], timeout: float,
            log) -> tuple[int | None, bool]:
    root = os.path.join(base, "root")
    os.mkdir(root, 0o700)
    uid, gid, privileged = os.geteuid(), os.getegid(), False
    if uid == 0:                     # root gives the program a user of its own, where JAIL_ID can own files
        try:
            for p in (work, program):
                os.chown(p, JAIL_ID, JAIL_ID)
            uid, gid, privileged = JAIL_ID, JAIL_ID, True
        except OSError:              # root of a user namespace that maps no such id: its own ids, as anyone's
            for p in (work, program):
                os.chown(p, 0, 0)
    readonly = [*SYSTEM, *{os.path.realpath(p) for p in (sys.base_prefix, sys.prefix)}]
    report_r, report_w = os.pipe()
    config = {"root": root, "work": work, "python": sys.executable, "program": str(program), "env": env,
              "limits": dict(zip(("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_NPROC", "RLIMIT_CORE"), limits)),
              "uid": uid, "gid": gid, "privileged": privileged, "readonly": readonly, "report": report_w}
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", str(JAIL), json.dumps(config)], cwd=base,
                                env={"PATH": SAFE_PATH, "LANG": "C.UTF-8"}, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                                pass_fds=(report_w,))
    finally:
        os.close(report_w)
    with os.fdopen(report_r, "r") as report:
        os.set_blocking(report.fileno(), False)
        lines: list[str] = []
        reading = threading.Lock()

        def kill() -> None:
            """The timeout: the jail's init, whose end ends every process in its namespace
            before the jail itself ends (so that none is left when this returns); the jail
            itself where init is not started yet."""
            with reading:
                lines.extend(_lines(report))
            init = next((line.split()[1] for line in lines if line.startswith("pid ")), None)
            with contextlib.suppress(OSError, ValueError):
                if init is not None:
                    os.kill(int(init), signal.SIGKILL)
                else:
                    os.killpg(proc.pid, signal.SIGKILL)

        timed_out = guard.wait_for(proc, timeout + SETUP_S, kill)
        with reading:
            lines.extend(_lines(report))
    said = dict(line.split(" ", 1) for line in lines if " " in line)
    if "error:" in said:
        raise SandboxError(f"the sandbox could not be built: {said['error:'].strip()}")
    if "exit" in said:
        return int(said["exit"]), False
    if "signal" in said:
        return -int(said["signal"]), False
    if timed_out:
        return None, True
    raise SandboxError(f"the sandbox ended without its program's status (exit status {proc.returncode})")


def _lines(report) -> list[str]:
    """What the jail's report holds now (it never blocks)."""
    try:
        return (report.read() or "").splitlines()
    except (BlockingIOError, TypeError):
        return []


_ISOLATION: list[str | None] = []


def isolation() -> str | None:
    """Why model-written code cannot run isolated on this machine (one line), or None when it
    can: a trivial program is run in the jail, once per process."""
    if not _ISOLATION:
        if not sys.platform.startswith("linux"):
            _ISOLATION.append("Linux namespaces are needed, and this is not Linux")
        else:
            try:
                outcome = run_python("", 10.0)
                _ISOLATION.append(None if outcome.ok else f"a trivial program failed there: {outcome.output.strip()}"[:300])
            except SandboxError as e:
                _ISOLATION.append(str(e))
    return _ISOLATION[0]


def _mounts_under(root: str) -> set[str]:
    """Mount points at or below `root`, from /proc/self/mountinfo (a bind mount of a folder of
    the same file system has the same device number: only the mount table tells)."""
    found = set()
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4:
                    point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
                    if point == root or point.startswith(root.rstrip("/") + "/"):
                        found.add(point)
    except OSError:
        pass
    return found


def remove_tree(root: str) -> None:
    """Remove the folder `root` and what is in it, as far as it goes without crossing a mount
    (what is mounted in it is left, and so is the mount point) or following a link (a link is
    removed, not what it names); folders the program made unreadable are opened up first."""
    mounts = _mounts_under(root)
    try:
        top = os.lstat(root)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(top.st_mode) or root in mounts:
        return

    def empty(fd: int, path: str) -> None:
        with os.scandir(fd) as entries:
            names = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
        for name, is_dir in names:
            inner = os.path.join(path, name)
            if not is_dir:
                try:
                    os.unlink(name, dir_fd=fd)
                except OSError:
                    pass
                continue
            if inner in mounts:
                continue
            try:
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except PermissionError:
                try:
                    os.chmod(name, stat.S_IRWXU, dir_fd=fd, follow_symlinks=False)
                    sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except OSError:
                    continue
            except OSError:
                continue
            try:
                if os.fstat(sub).st_dev != top.st_dev:          # mounted meanwhile, or another file system
                    continue
                os.fchmod(sub, stat.S_IRWXU)
                empty(sub, inner)
            finally:
                os.close(sub)
            try:
                os.rmdir(name, dir_fd=fd)
            except OSError:
                pass

    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        os.fchmod(fd, stat.S_IRWXU)
        empty(fd, root)
    finally:
        os.close(fd)
    try:
        os.rmdir(root)
    except OSError:
        pass
