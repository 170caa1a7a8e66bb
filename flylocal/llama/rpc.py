"""llama.cpp's rpc servers, seen from flylocal: their addresses, and whether one answers
(docs/scale-out.md). Nothing here imports llama.cpp.

An rpc server (`flylocal rpc-server`, or llama.cpp's own `rpc-server` of the same source)
serves its machine's devices to one client at a time, over TCP, without authentication. Every
call of the protocol is `cmd (1 byte) | size (u64) | data`, answered by `size (u64) | data`;
the first is always HELLO, which this module speaks to check a server before a model is
placed on it: ggml itself aborts its process when a server cannot be reached, and waits
without limit for one that does not answer.
"""

from __future__ import annotations

import socket
import struct
import time

from flylocal.errors import FlylocalError

DEFAULT_PORT = 50052
PROTOCOL_MAJOR = 7          # the RPC protocol of the llama.cpp this project builds (ggml-rpc.h)
HELLO = 14                  # RPC_CMD_HELLO, fixed across protocol versions
CAPS = 24                   # transport capabilities, sent and answered with HELLO
HELLO_TIMEOUT = 5.0         # seconds a server has to answer HELLO


def parse_endpoint(text: str) -> str:
    """`HOST:PORT`, checked; a FlylocalError names what is wrong. llama.cpp's RPC client
    connects over IPv4 only (a host name or an IPv4 address)."""
    text = text.strip()
    if text.count(":") > 1 or text.startswith("["):
        raise FlylocalError(f"{text!r}: llama.cpp's RPC client connects over IPv4 only; give a host name or an "
                            "IPv4 address")
    host, sep, port = text.partition(":")
    if not sep or not host or not port:
        raise FlylocalError(f"{text!r} is not an rpc server address: give HOST:PORT, such as 127.0.0.1:{DEFAULT_PORT}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise FlylocalError(f"{text!r}: the port must be a number from 1 to 65535")
    if not all(c.isascii() and (c.isalnum() or c in ".-_") for c in host):
        raise FlylocalError(f"{text!r} is not an rpc server address: a host is a name or an IPv4 address")
    return f"{host}:{int(port)}"


def parse_endpoints(text: str) -> tuple[str, ...]:
    """`HOST:PORT[,HOST:PORT...]`, each checked, none twice."""
    endpoints = tuple(parse_endpoint(part) for part in text.split(",") if part.strip())
    if not endpoints:
        raise FlylocalError("no rpc server given: HOST:PORT[,HOST:PORT...]")
    twice = {e for e in endpoints if endpoints.count(e) > 1}
    if twice:
        raise FlylocalError(f"rpc server {sorted(twice)[0]} is given twice")
    return endpoints


def split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.partition(":")
    return host, int(port)


class Unanswered(FlylocalError):
    """An rpc server that did not answer HELLO: `endpoint`, and `reason` in a few words."""

    def __init__(self, endpoint: str, reason: str, message: str | None = None):
        super().__init__(message or f"cannot reach rpc server {endpoint} ({reason})")
        self.endpoint, self.reason = endpoint, reason


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("it closed the connection")
        data += chunk
    return data


def hello(endpoint: str, timeout: float = HELLO_TIMEOUT) -> tuple[int, int, int]:
    """The protocol version the rpc server at `endpoint` answers HELLO with, within `timeout`
    seconds; a FlylocalError that names the server and what went wrong otherwise."""
    host, port = split(endpoint)
    try:
        with socket.create_connection((socket.gethostbyname(host), port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(struct.pack("<BQ", HELLO, CAPS) + bytes(CAPS))
            size = struct.unpack("<Q", _recv_exactly(sock, 8))[0]
            if size < 3 or size > 4096:
                raise Unanswered(endpoint, "not an rpc server", f"{endpoint} does not speak llama.cpp's RPC "
                                 f"protocol (HELLO answered with {size} bytes)")
            major, minor, patch = _recv_exactly(sock, size)[:3]
    except socket.timeout:
        raise Unanswered(endpoint, f"no answer within {timeout:g} s",
                         f"rpc server {endpoint} did not answer within {timeout:g} s (an rpc server serves one "
                         "client at a time: is another one using it?)") from None
    except socket.gaierror as e:
        raise Unanswered(endpoint, f"cannot resolve {host}", f"rpc server {endpoint}: cannot resolve {host} "
                         f"({e.strerror})") from None
    except ConnectionError as e:      # a server dying while it is asked can reset instead of refuse
        reason = {ConnectionRefusedError: "connection refused", ConnectionResetError: "connection reset"}
        raise Unanswered(endpoint, reason.get(type(e), e.strerror or str(e))) from None
    except OSError as e:
        raise Unanswered(endpoint, e.strerror or str(e)) from None
    if major != PROTOCOL_MAJOR:
        raise FlylocalError(f"rpc server {endpoint} speaks RPC protocol {major}.{minor}.{patch}; this build speaks "
                            f"{PROTOCOL_MAJOR}.x: run the same llama.cpp version on both sides")
    return major, minor, patch


def check_servers(endpoints, timeout: float = HELLO_TIMEOUT) -> None:
    """Every server answers HELLO (one-line FlylocalError naming the first that does not)."""
    for endpoint in endpoints:
        hello(endpoint, timeout)


def silent_servers(endpoints, timeout: float = 1.0) -> list[Unanswered]:
    """Each server that does not answer now, with why."""
    silent = []
    for endpoint in endpoints:
        try:
            hello(endpoint, timeout)
        except Unanswered as e:
            silent.append(e)
    return silent


READY_WAIT = 20.0       # seconds a starting server has to answer its own HELLO


def server_host(host: str) -> str:
    """The IPv4 address ggml's rpc server can listen on for `host` (it takes IPv4 addresses only)."""
    import ipaddress

    if host == "localhost":
        return "127.0.0.1"
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        raise FlylocalError(f"--host {host}: give an IPv4 address (llama.cpp's rpc server listens on IPv4 only), "
                            "such as 127.0.0.1 or 0.0.0.0") from None


def serve(host: str, port: int, threads: int | None, cache_dir: str | None, log) -> None:
    """`flylocal rpc-server`: serve this machine's devices (its GPUs, or its CPU) at
    HOST:PORT (an IPv4 address) with ggml's rpc server until the process is stopped. `log`
    gets one line once the server answers."""
    import os
    import signal
    import threading

    from flylocal.llama.devices import local_devices, serve_rpc
    from flylocal.host import usable_cores

    endpoint = f"{host}:{port}"
    if cache_dir:
        try:
            os.makedirs(cache_dir, exist_ok=True)
        except OSError as e:
            raise FlylocalError(f"cannot create the --cache directory {cache_dir}: {e.strerror}") from None
    devices = local_devices()
    n = threads or usable_cores()
    # ggml's server prints each connection on stdout; flylocal's lines go to stderr.
    if not os.environ.get("FLYLOCAL_VERBOSE"):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    # SIGTERM (a service manager, `kill`) is the normal way to stop it: exit 0, as serve does;
    # from before the server answers, since a client may see it answer before this process does.
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stopped.set())
    server = threading.Thread(target=serve_rpc, args=(endpoint, cache_dir, n, devices), daemon=True,
                              name="rpc-server")
    server.start()
    probe = f"127.0.0.1:{port}" if host == "0.0.0.0" else endpoint
    deadline = time.monotonic() + READY_WAIT
    while True:
        if stopped.is_set():
            log(f"rpc server on {endpoint} stopped")
            return
        if not server.is_alive():
            raise FlylocalError(f"the rpc server could not start on {endpoint}")
        try:
            version = hello(probe, timeout=1.0)
            break
        except FlylocalError:
            if time.monotonic() > deadline:
                raise FlylocalError(f"the rpc server on {endpoint} did not answer within {READY_WAIT:g} s") from None
            time.sleep(0.05)
    what = ", ".join(f"{d.name} ({d.description}, {d.free >> 20} MiB free of {d.total >> 20})" for d in devices)
    log(f"rpc server on {endpoint} (protocol {'.'.join(map(str, version))}, {n} threads"
        f"{', tensor cache ' + cache_dir if cache_dir else ''}): {what}. It has no authentication: only trusted "
        "machines should reach it. Ctrl-C stops it.")
    while server.is_alive():
        if stopped.is_set():
            log(f"rpc server on {endpoint} stopped")
            return
        server.join(0.5)
    raise FlylocalError(f"the rpc server on {endpoint} stopped")
