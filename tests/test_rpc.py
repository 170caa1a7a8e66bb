"""Models on llama.cpp rpc servers (flylocal.llama.rpc, flylocal.llama.remote; docs/scale-out.md).

Every server here is a real `flylocal rpc-server` on loopback, started by the test on a free
port and ended by its pid. The servers and the clients run the batch-invariant build (the
suite's default), so a target on rpc servers must give plain local greedy output token for
token: the same kernels run on the same batches, only elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from conftest import SMOL, SMOL_Q4_0, model_path, prompt
from flylocal.errors import FlylocalError
from flylocal.llama import rpc
from flylocal.loader import check
from flylocal.settings import Settings

PROMPTS = {"copy": prompt("typos-short"), "own-words": prompt("poem-autumn")}


# ----- addresses, and servers that are not there (no llama.cpp) -----

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("text,expected", [
    ("127.0.0.1:50052", ("127.0.0.1:50052",)),
    (" gpu-box:50052 , 10.0.0.2:7 ", ("gpu-box:50052", "10.0.0.2:7")),
])
def test_endpoints_parse(text, expected):
    assert rpc.parse_endpoints(text) == expected


@pytest.mark.parametrize("text,words", [
    ("gpu-box", "HOST:PORT"), ("gpu-box:0", "1 to 65535"), ("gpu-box:http", "1 to 65535"),
    ("[::1]:50052", "IPv4"), ("::1:50052", "IPv4"), ("a:1,a:1", "twice"), (",", "no rpc server"),
    ("gpu box:50052", "a name or an IPv4 address"), ("gpu\x00box:50052", "a name or an IPv4 address"),
    ("gpü-box:50052", "a name or an IPv4 address"),
])
def test_bad_endpoints_name_the_problem(text, words):
    with pytest.raises(FlylocalError, match=words):
        rpc.parse_endpoints(text)


def test_nothing_listening_is_refused_at_once():
    endpoint = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(rpc.Unanswered) as e:
        rpc.hello(endpoint)
    assert time.monotonic() - t0 < 2
    assert e.value.endpoint == endpoint and e.value.reason == "connection refused"
    assert str(e.value) == f"cannot reach rpc server {endpoint} (connection refused)"


@contextlib.contextmanager
def fake_server(answer: bytes | None):
    """A TCP server that reads HELLO and answers `answer` (None: never answers)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    stop = threading.Event()

    def serve():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                conn.recv(64)
                if answer is not None:
                    conn.sendall(answer)
                stop.wait(5)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        listener.close()


def test_a_server_that_does_not_answer_is_bounded():
    with fake_server(None) as endpoint:
        t0 = time.monotonic()
        with pytest.raises(rpc.Unanswered, match="did not answer within 0.5 s"):
            rpc.hello(endpoint, timeout=0.5)
        assert time.monotonic() - t0 < 2


def test_something_else_on_the_port_is_named():
    with fake_server(b"HTTP/1.1 400 Bad Request\r\n\r\n") as endpoint:
        with pytest.raises(FlylocalError, match="does not speak llama.cpp's RPC protocol"):
            rpc.hello(endpoint, timeout=2)


def test_another_protocol_version_is_named():
    with fake_server(struct.pack("<Q", 28) + bytes([6, 1, 0, 0]) + bytes(24)) as endpoint:
        with pytest.raises(FlylocalError, match="speaks RPC protocol 6.1.0; this build speaks 7.x"):
            rpc.hello(endpoint, timeout=2)


def test_a_real_reply_is_read():
    with fake_server(struct.pack("<Q", 28) + bytes([7, 0, 3, 0]) + bytes(24)) as endpoint:
        assert rpc.hello(endpoint, timeout=2) == (7, 0, 3)


@pytest.mark.parametrize("settings,words", [
    (Settings(draft="d", target_rpc=("a:1", "b:2"), draft_rpc=("b:2",)), "both the target and the draft"),
    (Settings(tensor_split=(1.0, 1.0)), "--tensor-split shares the target"),
    (Settings(draft_rpc=("a:1",)), "--draft-rpc places a draft model"),
])
def test_placements_no_server_can_run_are_refused(settings, words):
    with pytest.raises(FlylocalError, match=words):
        check(settings)


def flylocal(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "flylocal", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.mark.parametrize("args,words", [
    (["rpc-server", "--host", "0.0.0.0"], "add --allow-remote"),
    (["rpc-server", "--host", "::1"], "IPv4"),
    (["generate", "--target-rpc", "gpu-box", "hi"], "HOST:PORT"),
    (["generate", "--target-rpc", "a:1", "--tensor-split", "1,x", "hi"], "comma-separated list of numbers"),
    (["generate", "--target-rpc", "a:1", "--tensor-split", "0,0", "hi"], "not all 0"),
    (["generate", "--target-rpc", "a:1", "--rpc-timeout", "0", "hi"], "rpc-timeout"),
])
def test_bad_options_are_one_line(args, words):
    done = flylocal(*args)
    assert done.returncode != 0
    assert words in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_port_in_use_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = flylocal("rpc-server", "--port", str(port))
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and len(done.stderr.strip().splitlines()) == 1


# ----- real servers -----

# One thread per server: on a 2-core machine the server, the worker and the test's own models
# take turns, and a server's threads spinning at a barrier while another process holds the
# core would only slow every call. Logits do not depend on the thread count.
SERVER_ARGS = ("--threads", "1")


def launch(endpoint: str, *extra: str):
    """A flylocal rpc-server process for loopback `endpoint`: (process, the file of its stderr)."""
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "flylocal", "rpc-server", "--port", endpoint.split(":")[1],
                             *SERVER_ARGS, *extra], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
    return proc, log


def start_server(endpoint: str):
    """A flylocal rpc-server at loopback `endpoint`, once it answers; the caller ends it."""
    proc, log = launch(endpoint)
    try:
        wait_ready(proc, endpoint, log)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        log.close()
    return proc


@contextlib.contextmanager
def rpc_servers(n: int, *extra: str):
    """`n` flylocal rpc-server processes on free loopback ports: [(process, endpoint)]."""
    servers = []
    try:
        for _ in range(n):
            endpoint = f"127.0.0.1:{free_port()}"
            proc, log = launch(endpoint, *extra)
            servers.append((proc, endpoint, log))
        for proc, endpoint, log in servers:
            wait_ready(proc, endpoint, log)
        yield [(proc, endpoint) for proc, endpoint, _ in servers]
    finally:
        for proc, _, log in servers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
            log.close()


def wait_ready(proc, endpoint: str, log, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while True:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"rpc-server {endpoint} exited: {log.read().decode(errors='replace')}")
        try:
            rpc.hello(endpoint, timeout=1)
            return
        except FlylocalError:
            if time.monotonic() > deadline:
                pytest.fail(f"rpc-server {endpoint} did not answer within {limit:g} s")
            time.sleep(0.1)


def remote(endpoints, tensor_split=(), n_ctx=2048, rpc_timeout=60.0, output="here"):
    from flylocal.llama.runtime import RuntimeConfig
    from flylocal.loader import open_model

    return open_model(model_path(SMOL), RuntimeConfig(n_ctx=n_ctx, rpc=tuple(endpoints), tensor_split=tensor_split,
                                                      rpc_timeout=rpc_timeout, rpc_output=output))


# A fixed --k where a test is not about draft lengths: an adaptive length measures the decode's
# cost curve first, and beside an rpc-server on this same machine the server's work is load,
# so the curve stays provisional and every process measures it again.
def strict_run(target, drafter, ids, k, draft=None, max_tokens=32):
    from flylocal.decoding.drafters import make_drafter
    from flylocal.decoding.engine import Engine, EngineConfig, generate_all
    from flylocal.decoding.verifiers.strict import Strict

    engine = Engine(target, make_drafter(drafter, target, draft, adaptive=k is None and drafter == "pld"), Strict(),
                    EngineConfig(max_tokens=max_tokens, k=8 if k is None else k))
    tokens, stats, _ = generate_all(engine, ids)
    return tokens, stats


@pytest.mark.slow
# One prompt each: a copying one where the output layer is here, one in its own words where
# the server computes it.
@pytest.mark.parametrize("output,name", [("here", "copy"), ("server", "own-words")])
def test_strict_on_one_server_equals_local_greedy(smol, smol_draft, output, name):
    from flylocal.loader import encode_prompt

    with rpc_servers(1) as servers, remote([e for _, e in servers], output=output) as target:
        assert target.devices and target.devices[0].name.startswith("RPC")
        text = PROMPTS[name]
        ids, _ = encode_prompt(smol, text, raw=False)
        assert list(target.tokenize_chat([{"role": "user", "content": text}])) == list(ids)
        expected, _ = strict_run(smol, "none", ids, 0)
        assert strict_run(target, "none", ids, 0)[0] == expected, name
        # every drafter's own path is tested on a local target (test_exact.py); here the
        # remote cache meets drafts, rollbacks and an adaptive length (mla drafts with the
        # draft model, and with lookup)
        for drafter, k in [("pld", None), ("mla", 8)]:
            tokens, stats = strict_run(target, drafter, ids, k, draft=smol_draft)
            assert tokens == expected, (name, drafter, k)
            if k is not None:
                assert stats.drafted > 0
        # a rolled-back remote cache gives what a fresh one does
        target.truncate(len(ids) // 2)
        assert strict_run(target, "mla", ids, 8, draft=smol_draft)[0] == expected


@pytest.mark.slow
def test_strict_split_across_two_servers_equals_local_greedy(smol, smol_draft):
    from flylocal.loader import encode_prompt

    ids, _ = encode_prompt(smol, PROMPTS["copy"], raw=False)
    expected, _ = strict_run(smol, "none", ids, 0)
    with rpc_servers(2) as servers:
        endpoints = [e for _, e in servers]
        for split, output in [((1.0, 1.0), "here"), ((3.0, 1.0), "server")]:
            with remote(endpoints, tensor_split=split, output=output) as target:
                assert len(target.devices) == 2
                assert strict_run(target, "mla", ids, 8, draft=smol_draft)[0] == expected, split
                assert strict_run(target, "pld", ids, None if output == "here" else 8)[0] == expected, split


@pytest.mark.slow
def test_a_lost_server_leaves_the_draft_consistent_and_reconnects(smol):
    """Killed mid-generation: one FlylocalError naming the server at once; the local draft is
    untouched; once a server answers on that address again, reconnect() gives the output a
    fresh run gives."""
    from flylocal.decoding.engine import generate_all
    from flylocal.loader import encode_prompt, load

    ids, _ = encode_prompt(smol, PROMPTS["own-words"], raw=False)
    expected, _ = strict_run(smol, "none", ids, 0, max_tokens=200)
    with rpc_servers(1) as servers:
        (proc, endpoint), = servers
        settings = Settings(target=str(model_path(SMOL)), draft=str(model_path(SMOL_Q4_0)), target_rpc=(endpoint,),
                            verifier="strict", drafter="mla", k=6, max_tokens=200, ctx=2048)
        models = load(settings)
        try:
            gen = models.engine().generate(ids)
            events = iter(gen)
            next(events)
            proc.kill()
            proc.wait()
            t0 = time.monotonic()
            with pytest.raises(FlylocalError) as e:
                for _ in events:
                    pass
            assert time.monotonic() - t0 < 5
            message = str(e.value)
            assert f"lost rpc server {endpoint} (connection refused)" in message and "/reset" in message
            assert gen.stats.stop == "error" and gen.tokens == expected[: len(gen.tokens)]
            assert models.target.lost and models.draft.n_past > 0     # the draft is open and holds its cache
            with pytest.raises(FlylocalError, match="lost rpc server"):
                models.engine().generate(ids).run()
            with pytest.raises(FlylocalError, match="connection refused"):
                models.reconnect()

            again = start_server(endpoint)     # the same address
            try:
                assert models.reconnect() == [models.target.name]
                assert models.reconnect() == []
                tokens, _, _ = generate_all(models.engine(), ids)
                assert tokens == expected
            finally:
                again.kill()
                again.wait()
        finally:
            models.close()


@pytest.mark.slow
def test_killed_server_mid_generation_is_one_line_in_bounded_time():
    with rpc_servers(1) as servers:
        (proc, endpoint), = servers
        gen = subprocess.Popen([sys.executable, "-m", "flylocal", "generate", "--target-rpc", endpoint, "--raw",
                                "--verifier", "strict", "--max-tokens", "1500", "--ctx", "2048", "--k", "4",
                                "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        first = gen.stdout.read(8)        # generating: text is coming out
        assert first
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        out, err = gen.communicate(timeout=60)
        waited = time.monotonic() - t0
    err = err.decode()
    assert gen.returncode == 1
    assert waited < 5, waited
    assert "Traceback" not in err and "GGML" not in err
    assert err.strip().splitlines() == [err.strip().splitlines()[0]]
    # Refused, or reset where the probe reached the socket as the kill closed it (a busy machine).
    assert (f"lost rpc server {endpoint} (connection refused)" in err
            or f"lost rpc server {endpoint} (connection reset)" in err), err


@pytest.mark.slow
def test_a_stopped_server_is_bounded_by_rpc_timeout():
    with rpc_servers(1) as servers:
        (proc, endpoint), = servers
        gen = subprocess.Popen([sys.executable, "-m", "flylocal", "generate", "--target-rpc", endpoint, "--raw",
                                "--rpc-timeout", "2", "--verifier", "strict", "--max-tokens", "1500", "--ctx", "2048",
                                "--k", "4", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert gen.stdout.read(8)
        os.kill(proc.pid, signal.SIGSTOP)          # alive, listening, silent
        t0 = time.monotonic()
        _, err = gen.communicate(timeout=60)
        waited = time.monotonic() - t0
    err = err.decode()
    assert gen.returncode == 1 and "Traceback" not in err
    # Bounded: --rpc-timeout 2 and the 1 s check of the server, with room for a busy machine to
    # end the process (without the bound it would wait forever, here until the 60 s limit).
    assert waited < 30, waited
    assert f"lost rpc server {endpoint} (no answer within 1 s)" in err


@pytest.mark.slow
def test_sigterm_stops_an_rpc_server_with_exit_0():
    """SIGTERM is how a service manager stops a server: exit 0, one line, no traceback."""
    with rpc_servers(1) as servers:
        (proc, endpoint), = servers
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


@pytest.mark.slow
def test_unreachable_at_start_is_one_line():
    endpoint = f"127.0.0.1:{free_port()}"
    done = flylocal("generate", "--target-rpc", endpoint, "hi")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip() == f"flylocal: error: cannot reach rpc server {endpoint} (connection refused)"


@pytest.mark.slow
def test_chat_goes_on_with_reset_once_the_server_is_back():
    endpoint = f"127.0.0.1:{free_port()}"
    server = start_server(endpoint)
    chat = subprocess.Popen([sys.executable, "-m", "flylocal", "chat", "--target-rpc", endpoint, "--max-tokens", "12",
                             "--verifier", "strict", "--k", "4"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        def send(line):
            chat.stdin.write(line + "\n")
            chat.stdin.flush()

        def stderr_until(words):
            lines = []
            while True:
                line = chat.stderr.readline()
                assert line, f"chat ended; stderr so far: {lines}"
                lines.append(line)
                if words in line:
                    return lines

        send("What is rain?")
        stderr_until("[strict:")
        server.kill()
        server.wait()
        send("And snow?")
        lost = stderr_until("[strict:")
        assert any(f"error: lost rpc server {endpoint}" in line for line in lost)
        send("/reset")
        assert any("connection refused" in line for line in stderr_until("error:"))
        server = start_server(endpoint)
        send("/reset")
        assert any("reconnected to its rpc servers" in line for line in stderr_until("new conversation"))
        send("What is rain?")
        stderr_until("[strict: 12 tokens")
        out, err = chat.communicate(timeout=60)      # closes stdin: chat ends
        assert chat.returncode == 0 and "Traceback" not in err
    finally:
        if chat.poll() is None:
            chat.kill()
        server.kill()
        server.wait()


@pytest.mark.slow
def test_doctor_reports_the_remote_devices_and_round_trips():
    with rpc_servers(1) as servers:
        (_, endpoint), = servers
        done = flylocal("doctor", "--target-rpc", endpoint, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    devices = next(line for line in lines if line.startswith("rpc servers:"))
    assert endpoint in devices and "RPC" in devices and "MiB free" in devices
    trip = next(line for line in lines if line.startswith("round trip of a decode"))
    assert all(f"{n}: " in trip for n in (1, 2, 5, 9))
    assert any(line.startswith("decode cost curve (") for line in lines)


@pytest.mark.slow
def test_an_interrupted_call_leaves_nothing_stale(smol):
    """Ctrl-C while a decode is on its way: the reply it is owed is read before the next call,
    and the next generation gives what a fresh one does."""
    from flylocal.loader import encode_prompt

    ids, _ = encode_prompt(smol, PROMPTS["copy"], raw=False)
    expected, _ = strict_run(smol, "none", ids, 0)
    with rpc_servers(1) as servers, remote([e for _, e in servers]) as target:
        original, calls = target.context._reply, []

        def interrupted(limit):
            calls.append(limit)
            if len(calls) == 6:
                raise KeyboardInterrupt
            return original(limit)

        target.context._reply = interrupted
        with pytest.raises(KeyboardInterrupt):
            strict_run(target, "pld", ids, 8)
        target.context._reply = original
        assert target.context._pending == 1
        assert strict_run(target, "pld", ids, 8)[0] == expected
        assert target.context._pending == 0


@pytest.mark.slow
def test_ctrl_c_ends_quietly_and_leaves_no_worker():
    with rpc_servers(1) as servers:
        (_, endpoint), = servers
        gen = subprocess.Popen([sys.executable, "-m", "flylocal", "generate", "--target-rpc", endpoint, "--raw",
                                "--max-tokens", "1500", "--ctx", "2048", "--k", "4",
                                "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert gen.stdout.read(8)
        workers = subprocess.run(["pgrep", "-f", "flylocal.llama.worker"], capture_output=True, text=True).stdout.split()
        assert workers
        gen.send_signal(signal.SIGINT)
        _, err = gen.communicate(timeout=60)
        assert gen.returncode == 130 and "Traceback" not in err.decode()

        def worker_alive(pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    return b"flylocal.llama.remote" in f.read()
            except OSError:
                return False

        deadline = time.monotonic() + 5
        while any(map(worker_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(worker_alive, workers))


@contextlib.contextmanager
def byte_counter(upstream: str):
    """A loopback proxy in front of `upstream` that counts the bytes the server sends: [count]."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    down = [0]

    def pump(src, dst, count):
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 20):
                if count:
                    down[0] += len(data)
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def accept():
        with contextlib.suppress(OSError):
            while True:
                client, _ = listener.accept()
                server = socket.create_connection(rpc.split(upstream))
                threading.Thread(target=pump, args=(client, server, False), daemon=True).start()
                threading.Thread(target=pump, args=(server, client, True), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}", down
    finally:
        listener.close()


@pytest.mark.slow
def test_with_the_output_layer_here_rows_come_back_as_hidden_states():
    """--rpc-output here: a verified row crosses the network as its hidden state (n_embd
    floats), not its n_vocab logits."""
    import numpy as np

    with rpc_servers(1) as servers:
        (_, endpoint), = servers
        with byte_counter(endpoint) as (proxy, down):
            per_decode = {}
            for output in ("here", "server"):
                with remote([proxy], output=output) as target:
                    ids = target.tokenize(PROMPTS["copy"])
                    target.decode(ids[:-1])
                    before = down[0]
                    for _ in range(5):
                        target.decode(np.full(9, ids[-1], dtype=np.int32), logits_from=0)
                        target.truncate(len(ids) - 1)
                    per_decode[output] = (down[0] - before) / 5
                    row = 4 * target.n_vocab
    assert per_decode["server"] >= 9 * row
    assert per_decode["here"] < 9 * row / 20, per_decode


@pytest.mark.slow
def test_a_draft_on_a_server_drafts_for_a_local_target(smol):
    """--draft-rpc: the draft model's layers on a server, the target here; strict is still the
    target's greedy output, and the draft really drafted."""
    from flylocal.decoding.engine import generate_all
    from flylocal.loader import encode_prompt, load

    ids, _ = encode_prompt(smol, PROMPTS["copy"], raw=False)
    expected, _ = strict_run(smol, "none", ids, 0)
    with rpc_servers(1) as servers:
        (_, endpoint), = servers
        models = load(Settings(target=str(model_path(SMOL)), draft=str(model_path(SMOL_Q4_0)), draft_rpc=(endpoint,),
                               verifier="strict", drafter="model", k=6, max_tokens=len(expected), ctx=2048))
        try:
            assert models.draft.devices and not getattr(models.target, "devices", None)
            tokens, stats, _ = generate_all(models.engine(), ids)
        finally:
            models.close()
    assert tokens == expected and stats.accepted > 0


@pytest.mark.slow
def test_serve_answers_again_once_its_server_is_back():
    """flylocal serve with the target on an rpc server: a request while the server is gone gets
    the one-line error; the first request after it is back reconnects and gets the same text."""
    import httpx

    endpoint, api = f"127.0.0.1:{free_port()}", free_port()
    server = start_server(endpoint)
    serve = subprocess.Popen([sys.executable, "-m", "flylocal", "serve", "--port", str(api), "--threads", "1",
                              "--target-rpc", endpoint, "--verifier", "strict", "--ctx", "1024", "--k", "4"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{api}"
    body = {"prompt": "The sky is", "max_tokens": 12}
    try:
        deadline = time.monotonic() + 120
        while True:
            assert serve.poll() is None, serve.stderr.read()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "serve did not become ready"
            time.sleep(0.2)
        first = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert first.status_code == 200
        server.kill()
        server.wait()
        lost = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert lost.status_code >= 500 and f"rpc server {endpoint}" in lost.json()["error"]["message"]
        server = start_server(endpoint)
        again = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert again.status_code == 200
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    finally:
        serve.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            serve.wait(30)
        if serve.poll() is None:
            serve.kill()
        server.kill()
        server.wait()
    assert "Traceback" not in serve.stderr.read()
