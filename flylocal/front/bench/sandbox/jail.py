"""The sandbox's jail: run as a script (`python -I -S jail.py CONFIG`), on the standard library
alone, by flylocal.front.bench.sandbox, never imported. It runs one program where (docs/operations.md,
"Running model-written code"):

- it has no network: a network namespace of its own, whose loopback is down;
- it sees a root of its own, read-only: the system's /usr and libraries, the interpreter and its
  environment, a /dev of null, zero, full, random and urandom, a /proc of its own processes,
  and its folder, the one place it may write;
- it cannot see or signal the caller: a PID namespace whose first process is this script's
  `init`, and a user namespace in which it is an unprivileged user (mapped to an unused id
  where the caller is root, to the caller's own otherwise) holding no capability, with no
  supplementary group and no way to gain privileges (PR_SET_NO_NEW_PRIVS, nosuid mounts);
- its processes are limited (RLIMIT_NPROC, counted in its own user namespace, root or not),
  with the guard's limits on CPU time, memory, file size and core files;
- nothing it starts outlives it: when the program ends, `init` ends, and the kernel kills
  every process left in the namespace; each process here dies with its parent
  (PR_SET_PDEATHSIG), this script with its caller, so a caller that ends, however it ends,
  ends them all.

    caller -> this script (the caller's namespaces; writes the child's id maps)
             -> child: unshare(user, mount, PID, network, IPC, UTS), waits for its maps
                -> init (PID 1): mounts the root, pivots into it -> the program (python -I)

CONFIG is JSON: root (an empty folder: the new root's mount point), work (the program's folder,
mounted at its own path), python, program, env, limits, uid/gid (the outer ids the jail's user
is mapped to), privileged (the caller is root, and maps its own root too), readonly (paths to mount read-only), report (a file descriptor). The report gets
one line, "pid N" (init's pid, for the caller to kill), then "exit N" or "signal N" for the
program, or "error: WHY" when the jail could not be built (exit status 125).
"""

import ctypes
import json
import os
import resource
import signal
import stat
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
INNER = 1000            # the program's uid and gid inside its user namespace: no capability survives its exec
DEVICES = ("null", "zero", "full", "random", "urandom")
FAILED = 125

libc = ctypes.CDLL(None, use_errno=True)


class Refused(Exception):
    pass


def call(what: str, result: int) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise Refused(f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags, data=None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    call(f"mount {target}", libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)))


def locked_flags(path: str) -> int:
    """The flags a read-only remount of a bind of `path` must keep: a mount made in another
    user namespace keeps its nosuid, nodev, noexec and atime flags (the kernel refuses a
    remount that drops them)."""
    f = os.statvfs(path).f_flag
    flags = 0
    for st, ms in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                   (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
                   (getattr(os, "ST_RELATIME", 4096), MS_RELATIME)):
        if f & st:
            flags |= ms
    if not flags & (MS_NOATIME | MS_RELATIME):
        flags |= MS_STRICTATIME
    return flags


def bind(source: str, target: str, writable: bool = False) -> None:
    mount(source, target, None, MS_BIND | MS_REC)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | locked_flags(source) | (0 if writable else MS_RDONLY)
    mount(None, target, None, flags)


def place(root: str, path: str, kind: str) -> str:
    """`path` made under `root` (its parents as folders), as an empty folder or file to mount
    on; the path under root."""
    inside = root + path
    os.makedirs(os.path.dirname(inside), exist_ok=True)
    if kind == "dir":
        os.makedirs(inside, exist_ok=True)
    elif not os.path.lexists(inside):
        open(inside, "w").close()
    return inside


def build_root(cfg: dict) -> None:
    """The program's root, mounted at cfg["root"], then made the root of this mount namespace."""
    root = cfg["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)          # nothing here propagates back to the caller
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    done: list[str] = []
    for path in cfg["readonly"]:
        if any(path == d or path.startswith(d.rstrip("/") + "/") for d in done) or not os.path.lexists(path):
            continue
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):                      # /bin -> usr/bin: the same link
            os.makedirs(os.path.dirname(root + path), exist_ok=True)
            os.symlink(os.readlink(path), root + path)
            continue
        bind(path, place(root, path, "dir" if stat.S_ISDIR(st.st_mode) else "file"))
        done.append(path)
    dev = place(root, "/dev", "dir")
    mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    for name in DEVICES:
        mount(f"/dev/{name}", place(root, f"/dev/{name}", "file"), None, MS_BIND)
    for name, link in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                       ("stderr", "/proc/self/fd/2")):
        os.symlink(link, f"{dev}/{name}")
    mount(None, dev, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    try:                                                   # a /proc of this PID namespace only
        mount("proc", place(root, "/proc", "dir"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except Refused:
        pass                                               # a masked /proc (a container): the program gets none
    bind(cfg["work"], place(root, cfg["work"], "dir"), writable=True)
    os.chdir(root)
    call("pivot_root", libc.pivot_root(b".", b"."))
    call("umount the old root", libc.umount2(b".", MNT_DETACH))
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def init(cfg: dict, report) -> None:
    """PID 1 of the program's namespace: build its root, start the program, reap every child,
    and end with the program (which ends every process left)."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.setsid()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)               # PID 1 ignores these from inside its namespace
    build_root(cfg)
    try:
        libc.sethostname(b"sandbox", 7)
    except OSError:
        pass
    program = os.fork()
    if program == 0:
        try:
            for name, value in cfg["limits"].items():
                which = getattr(resource, name, None)
                if which is not None:
                    resource.setrlimit(which, (value, value))
            libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
            try:
                os.setgroups([])                        # a root caller's groups are no group of the program's
            except PermissionError:
                pass                                    # an unprivileged caller's: setgroups is denied
            os.setresgid(INNER, INNER, INNER)
            os.setresuid(INNER, INNER, INNER)
            os.chdir(cfg["work"])
            os.execve(cfg["python"], [cfg["python"], "-I", cfg["program"]], cfg["env"])
        except BaseException as e:  # noqa: BLE001 - said on the report, nothing else runs here
            report.write(f"error: cannot start the program: {e}\n")
            report.flush()
        os._exit(FAILED)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(FAILED)
        if pid == program:
            break
    if os.WIFSIGNALED(status):
        report.write(f"signal {os.WTERMSIG(status)}\n")
    else:
        report.write(f"exit {os.WEXITSTATUS(status)}\n")
    report.flush()
    os._exit(0)


def child(cfg: dict, report, told: int, go: int) -> None:
    """In new namespaces, once the caller's side has written the id maps: init's parent."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    try:
        call("unshare", libc.unshare(flags))
    except Refused as e:
        report.write(f"error: {e}\n")
        report.flush()
        os._exit(FAILED)
    os.write(told, b"u")
    if os.read(go, 1) != b"m":
        os._exit(FAILED)
    first = os.fork()
    if first == 0:
        try:
            init(cfg, report)
        except BaseException as e:  # noqa: BLE001 - said on the report
            report.write(f"error: {e}\n")
            report.flush()
        os._exit(FAILED)
    report.write(f"pid {first}\n")
    report.flush()
    _, status = os.waitpid(first, 0)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else FAILED)


def write_maps(pid: int, cfg: dict) -> None:
    """The jail's ids: the program's user (INNER) is cfg's uid and gid outside. An unprivileged
    caller can map only its own ids, and a gid map needs setgroups denied first. A root caller
    maps its own root too, as root inside, for init alone: init's files on the new root need an
    owner the namespace knows, and the paths it mounts may lie under folders only root reads."""
    root = cfg["privileged"]
    if not root:
        with open(f"/proc/{pid}/setgroups", "w") as f:
            f.write("deny")
    with open(f"/proc/{pid}/uid_map", "w") as f:
        f.write(("0 0 1\n" if root else "") + f"{INNER} {cfg['uid']} 1\n")
    with open(f"/proc/{pid}/gid_map", "w") as f:
        f.write(("0 0 1\n" if root else "") + f"{INNER} {cfg['gid']} 1\n")


def main() -> None:
    caller = os.getppid()
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)              # the caller killed: the jail goes with it
    if os.getppid() != caller:
        sys.exit(FAILED)
    cfg = json.loads(sys.argv[1])
    os.set_inheritable(cfg["report"], False)                 # the program never gets it
    report = os.fdopen(cfg["report"], "w")
    told_r, told_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(told_r)
        os.close(go_w)
        child(cfg, report, told_w, go_r)
    os.close(told_w)
    os.close(go_r)
    if os.read(told_r, 1) == b"u":
        try:
            write_maps(pid, cfg)
            os.write(go_w, b"m")
        except OSError as e:
            report.write(f"error: cannot map the sandbox's user: {e.strerror}\n")
            report.flush()
            os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else FAILED)


if __name__ == "__main__":
    main()
