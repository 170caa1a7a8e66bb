"""The sandbox model-written code runs in (flylocal/front/bench/sandbox, docs/operations.md "Running
model-written code"): each of the red team's escapes, tried from inside, must fail, and the caller
and its files must come out untouched; the folder's removal never crosses a mount; `bench
--execute` refuses in one line where namespaces cannot be had. These run real processes, no
model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from flylocal.front.bench.sandbox import PROCESSES, isolation, remove_tree, run_python

WHY = isolation()
needs_namespaces = pytest.mark.skipif(WHY is not None, reason=f"no namespaces here: {WHY}")


def run(code: str, timeout: float = 20.0):
    """Run `code` in the sandbox; (its outcome, its output's "key value" lines as a dict)."""
    outcome = run_python(textwrap.dedent(code), timeout)
    lines = dict(line.split(" ", 1) for line in outcome.output.splitlines() if " " in line)
    return outcome, lines


def tries(name: str, attempt: str) -> str:
    """A program line that prints `name ok` when `attempt` works, `name refused: WHY` otherwise."""
    return (f"try:\n    {attempt}\n    print({name!r}, 'ok')\n"
            f"except Exception as e:\n    print({name!r}, 'refused:', type(e).__name__, e)\n")


@needs_namespaces
def test_it_cannot_kill_or_see_its_caller(tmp_path):
    """os.kill(os.getppid(), 9), the caller's own pid, every process it may signal (-1) and its
    process group: the caller lives on, prints what the program said, and the program's folder
    is gone."""
    caller = textwrap.dedent("""\
        import os, sys
        from flylocal.front.bench.sandbox import run_python
        me = os.getpid()
        program = f'''
        import os, signal, sys
        sys.stdout.reconfigure(line_buffering=True)
        print("parent", os.getppid())
        for pid in (os.getppid(), {me}, -1, 0):
            try:
                os.kill(pid, signal.SIGKILL) if pid not in (-1, 0) else None
            except OSError as e:
                print("kill", pid, type(e).__name__)
        print("folder", os.getcwd())
        for pid in (-1, 0):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError as e:
                print("kill", pid, type(e).__name__)
        '''
        out = run_python(program, 20)
        print(out.output)
        print("alive", me, out.returncode)
        """)
    done = subprocess.run([sys.executable, "-c", caller], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    said = done.stdout
    assert "alive" in said and "parent 1" in said, said           # its parent is the sandbox's init
    me = said.split("alive ")[1].split()[0]
    assert "kill 1 PermissionError" in said                        # which it cannot signal
    assert f"kill {me} ProcessLookupError" in said                 # and the caller's pid names no process inside
    folder = said.split("folder ")[1].split()[0]
    assert not Path(folder).parent.exists()


@needs_namespaces
def test_it_cannot_write_or_read_outside_its_folder(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.txt"
    secret.write_text("the caller's secret")
    secret.chmod(0o644)
    probe = f"flylocal-probe-{os.getpid()}"
    out, lines = run(f"""
        import os
        {tries('write-outside', f"open({str(outside / 'new.txt')!r}, 'w').write('x')")}
        {tries('write-usr', f"open('/usr/{probe}', 'w').write('x')")}
        {tries('write-root', f"open('/{probe}', 'w').write('x')")}
        {tries('write-tmp', f"open('/tmp/{probe}', 'w').write('x')")}
        {tries('write-parent', "open(os.path.join(os.getcwd(), '..', 'escaped'), 'w').write('x')")}
        {tries('read-secret', f"print('secret-is', open({str(secret)!r}).read())")}
        {tries('read-shadow', "open('/etc/shadow').read()")}
        {tries('read-project', f"open({__file__!r}).read()")}
        {tries('write-own', "open('mine.txt', 'w').write('x')")}
        """.replace("\n        ", "\n"))
    assert out.ok, out.output
    for name in ("write-outside", "write-usr", "write-root", "write-tmp", "write-parent", "read-secret", "read-shadow",
                 "read-project"):
        assert lines[name].startswith("refused"), (name, lines[name])
    assert lines["write-own"] == "ok"
    assert "the caller's secret" not in out.output
    assert not (outside / "new.txt").exists() and not Path(f"/usr/{probe}").exists()
    assert not Path(f"/tmp/{probe}").exists() and not Path(f"/{probe}").exists()


@needs_namespaces
def test_it_cannot_reach_the_network_or_a_socket_of_the_caller(tmp_path):
    """A TCP server on the caller's loopback and an abstract UNIX socket: neither is reachable,
    and neither ever sees a connection."""
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(4)
    port = tcp.getsockname()[1]
    name = f"\0flylocal-sandbox-test-{os.getpid()}"
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(name)
    unix.listen(4)
    accepted = []

    def accept(s):
        s.settimeout(5)
        try:
            accepted.append(s.accept())
        except OSError:
            pass

    watchers = [threading.Thread(target=accept, args=(s,)) for s in (tcp, unix)]
    for w in watchers:
        w.start()
    try:
        out, lines = run(f"""
            import socket
            {tries('tcp', f"socket.create_connection(('127.0.0.1', {port}), timeout=2)")}
            {tries('unix', f"s = socket.socket(socket.AF_UNIX); s.settimeout(2); s.connect({name!r})")}
            {tries('dns', "socket.getaddrinfo('example.com', 80)")}
            """.replace("\n            ", "\n"))
    finally:
        for w in watchers:
            w.join()
        tcp.close()
        unix.close()
    assert out.ok, out.output
    for what in ("tcp", "unix", "dns"):
        assert lines[what].startswith("refused"), (what, lines[what])
    assert accepted == []


@needs_namespaces
def test_it_cannot_touch_the_callers_folder_through_proc(tmp_path, monkeypatch):
    """/proc/PPID/cwd and /proc/CALLER/cwd: the caller's working folder is out of reach, and a
    file there survives an attempt to delete it."""
    monkeypatch.chdir(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    me = os.getpid()
    out, lines = run(f"""
        import os
        {tries('ppid-cwd', "os.unlink(f'/proc/{{os.getppid()}}/cwd/victim.txt')")}
        {tries('caller-cwd', f"os.unlink('/proc/{me}/cwd/victim.txt')")}
        {tries('init-cwd', "os.listdir('/proc/1/cwd')")}
        {tries('init-root', "os.listdir('/proc/1/root/proc')")}
        """.replace("\n        ", "\n"))
    assert out.ok, out.output
    for name in ("ppid-cwd", "caller-cwd", "init-cwd", "init-root"):
        assert lines[name].startswith("refused"), (name, lines[name])
    assert victim.read_text() == "keep me"


def alive_with(marker: str) -> list[int]:
    found = []
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and marker.encode() in Path(f"/proc/{d}/cmdline").read_bytes():
                found.append(int(d))
        except OSError:
            continue
    return found


@needs_namespaces
def test_nothing_it_starts_outlives_it():
    """A setsid daemon that leaves the folder, a double fork, a new process group: all gone when
    the call returns, whether the program ends by itself or at the timeout."""
    marker = f"302.{os.getpid()}"
    program = f"""
        import os, subprocess, time
        subprocess.Popen(["sleep", "{marker}"], start_new_session=True, cwd="/")
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.chdir("/")
                os.execv("/bin/sleep", ["sleep", "{marker}"])
            os._exit(0)
        subprocess.Popen(["sleep", "{marker}"], preexec_fn=lambda: os.setpgid(0, 0))
        print("started", len(os.listdir("/proc")), flush=True)
        """
    for tail, timed_out in (("", False), ("time.sleep(60)\n", True)):
        out = run_python(textwrap.dedent(program) + tail, 2.0)
        assert out.timed_out == timed_out and "started" in out.output, out
        assert alive_with(marker) == []


@needs_namespaces
def test_processes_are_limited_as_root_too():
    """Forking past the limit fails inside (the caller may be root: the kernel counts the
    sandbox's user in its own namespace), and the forks die with the call."""
    marker = f"303.{os.getpid()}"
    out, lines = run(f"""
        import os, time
        made = 0
        for _ in range(4 * {PROCESSES}):
            try:
                pid = os.fork()
            except OSError as e:
                print("stopped", type(e).__name__)
                break
            if pid == 0:
                os.execv("/bin/sleep", ["sleep", "{marker}"])
            made += 1
        print("made", made)
        """.replace("\n        ", "\n"))
    assert out.ok, out.output
    assert int(lines["made"]) < PROCESSES and lines["stopped"] == "BlockingIOError", out.output
    assert alive_with(marker) == []


@needs_namespaces
def test_it_cannot_mount_anything_the_caller_sees(tmp_path):
    """A bind mount attempted from inside (directly, and in a user namespace of the program's
    own): refused, or confined to the program's namespace; the caller's files are untouched and
    the folder is removed."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    out, lines = run(f"""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        os.mkdir("m")
        def bind(src):
            if libc.mount(src.encode(), b"m", None, 4096 | 16384, None) != 0:
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        {tries('bind', f"bind({str(outside)!r})")}
        {tries('bind-own-ns', "libc.unshare(0x10000000 | 0x00020000) == 0 or 1/0; bind('/usr')")}
        print("folder", os.getcwd())
        """.replace("\n        ", "\n"))
    assert out.ok, out.output
    assert lines["bind"].startswith("refused")
    assert (outside / "keep.txt").read_text() == "keep" and not Path(lines["folder"]).parent.exists()


def test_the_folders_removal_never_crosses_a_mount_or_follows_a_link(tmp_path):
    """What the red team's bind mount did to the old cleanup: a folder with a bind mount of
    another folder and a link to a file outside it, removed: the mount's files and the linked
    file are untouched. Made in a user and mount namespace of the test's own (no root needed)."""
    if not Path("/usr/bin/unshare").exists() and not Path("/bin/unshare").exists():
        pytest.skip("util-linux's unshare is not installed")
    probe = subprocess.run(["unshare", "-Urm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no user namespaces here: {probe.stderr.decode().strip()}")
    outside, folder = tmp_path / "outside", tmp_path / "folder"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    (folder / "inner" / "m").mkdir(parents=True)
    (folder / "inner" / "file").write_text("x")
    (folder / "link").symlink_to(outside / "keep.txt")
    (folder / "dirlink").symlink_to(outside)
    script = textwrap.dedent(f"""\
        import ctypes, os, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        from flylocal.front.bench.sandbox import remove_tree
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.mount({str(outside).encode()!r}, {str(folder / 'inner' / 'm').encode()!r}, None, 4096, None) == 0
        remove_tree({str(folder)!r})
        print("kept", sorted(os.listdir({str(outside)!r})), os.path.exists({str(folder / 'inner' / 'file')!r}))
        """)
    done = subprocess.run(["unshare", "-Urm", sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "kept ['keep.txt'] False" in done.stdout
    assert (outside / "keep.txt").read_text() == "keep"
    remove_tree(str(folder))
    assert not folder.exists() and (outside / "keep.txt").exists()


def test_execute_refuses_in_one_line_where_namespaces_cannot_be_had(tmp_path):
    """A machine without user namespaces, made for the test (a namespace of its own allowing
    none): `bench --execute` says why in one line and exits non-zero before loading anything;
    --execute-unsafe is named as the way out."""
    probe = subprocess.run(["unshare", "-Ur", "true"], capture_output=True) if Path("/usr/bin/unshare").exists() \
        else None
    if probe is None or probe.returncode != 0:
        pytest.skip("util-linux's unshare and user namespaces are needed to make a machine without them")
    script = ("echo 0 > /proc/sys/user/max_user_namespaces && exec " + sys.executable +
              f" -m flylocal bench --tasks humaneval --execute --out {tmp_path / 'out'}")
    done = subprocess.run(["unshare", "-Ur", "sh", "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "isolated by Linux namespaces" in lines[0] and "--execute-unsafe" in lines[0], done.stderr
    assert "Traceback" not in done.stderr


@needs_namespaces
@pytest.mark.parametrize("how", ["SIGINT", "SIGKILL"])
def test_a_caller_stopped_midway_leaves_no_program_behind(how):
    """A Ctrl-C in the caller while a program runs, or the caller killed: the program and all it
    started end with the caller."""
    import signal
    import time

    marker = f"304.{os.getpid()}"
    caller = textwrap.dedent(f"""\
        import sys
        from flylocal.front.bench.sandbox import run_python
        print("started", flush=True)
        run_python('import os, subprocess, time\\nsubprocess.Popen(["sleep", "{marker}"], start_new_session=True)\\n'
                   'print("folder", os.getcwd(), flush=True)\\ntime.sleep(60)\\n', 60)
        """)
    proc = subprocess.Popen([sys.executable, "-c", caller], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 20
        while not alive_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive_with(marker), "the program did not start"
        proc.send_signal(getattr(signal, how))
        proc.wait(timeout=20)
    finally:
        proc.kill()
    deadline = time.monotonic() + 5
    while alive_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive_with(marker) == []
