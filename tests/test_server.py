"""`flylocal serve` on SmolLM2, over loopback, driven by the real `openai` client and httpx.

One server runs for the module (with an API key and a small queue); the tests talk to it as
clients would. Every request is bounded in tokens and time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import SMOL, SMOL_Q4_0, prompt

pytestmark = pytest.mark.slow      # a real model behind a real server

KEY = "test-key-123"
CTX = 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(*args: str, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flylocal", "serve", "--port", str(port), "--threads", "1", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_ready(proc: subprocess.Popen, url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited: {proc.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not become ready")


@pytest.fixture(scope="module")
def server():
    port = free_port()
    proc = start("--target", SMOL, "--draft", SMOL_Q4_0, "--api-key", KEY, "--max-queue", "8", "--ctx", str(CTX),
                 port=port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        assert proc.returncode == 0, proc.stderr.read()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server + "/v1", api_key=KEY, timeout=120, max_retries=0)


def ask(client, content: str, **kw):
    kw.setdefault("max_tokens", 32)
    return client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": content}], **kw)


STRICT = {"verifier": "strict"}


def test_chat_completion_streamed_and_not(client):
    whole = ask(client, prompt("chat-sky"), extra_body=STRICT)
    assert whole.object == "chat.completion" and whole.choices[0].finish_reason in ("stop", "length")
    text = whole.choices[0].message.content
    assert text and whole.usage.completion_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    mine = whole.usage.model_extra["flylocal"]
    assert mine["verifier"] == "strict" and mine["rounds"] > 0
    chunks = list(ask(client, prompt("chat-sky"), extra_body=STRICT, stream=True,
                      stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text                                   # strict: the same text either way
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]


def test_completions_endpoint(client):
    done = client.completions.create(model=SMOL, prompt="The capital of France is", max_tokens=8,
                                     extra_body=STRICT)
    assert done.object == "text_completion" and done.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=SMOL, prompt="The capital of France is", max_tokens=8, stream=True, extra_body=STRICT))
    assert streamed == done.choices[0].text
    marker = client.completions.create(model=SMOL, prompt="<|im_end|>", max_tokens=1, extra_body=STRICT)
    assert marker.usage.prompt_tokens > 3          # request text is plain text: not one control token


def test_stop_strings_even_across_tokens(client):
    full = ask(client, prompt("reply-email"), max_tokens=48, extra_body=STRICT).choices[0].message.content
    words = full.split(" ")
    assert len(words) > 6, full
    stop = " ".join(words[3:5])                  # two words: several tokens
    assert len(stop) > 3
    cut = full[: full.index(stop)]
    whole = ask(client, prompt("reply-email"), max_tokens=48, stop=[stop, "\u0000never"], extra_body=STRICT)
    assert whole.choices[0].message.content == cut and whole.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in ask(
        client, prompt("reply-email"), max_tokens=48, stop=stop, stream=True, extra_body=STRICT) if c.choices)
    assert streamed == cut


def test_the_same_seed_gives_the_same_text(client):
    # A fixed draft length: with an adaptive one, how many random draws a round takes depends on
    # measured timings (seed-keyed draws per position would lift that).
    fixed = {"k": 6, "drafter": "pld"}
    a, b, c = (ask(client, prompt("poem-autumn"), temperature=0.9, seed=s, max_tokens=24,
                   extra_body=fixed).choices[0].message.content for s in (7, 7, 8))
    assert a == b
    assert a != c or len(a) < 3


def test_strict_equals_flylocal_generate(client):
    answer = ask(client, prompt("qa-capital"), max_tokens=24, extra_body=STRICT).choices[0].message.content
    done = subprocess.run([sys.executable, "-m", "flylocal", "generate", prompt("qa-capital"), "--verifier", "strict",
                           "--max-tokens", "24", "--json", "--ctx", str(CTX), "--threads", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["text"] == answer


def test_concurrent_requests_are_each_answered_as_alone(server):
    questions = [prompt(p) for p in ("qa-capital", "qa-planet", "qa-math", "qa-france", "chat-sky", "chat-focus",
                                     "poem-autumn", "story-robot")]
    body = {"model": SMOL, "max_tokens": 16, "verifier": "strict"}
    headers = {"Authorization": f"Bearer {KEY}"}

    def post(q):
        r = httpx.post(server + "/v1/chat/completions", headers=headers, timeout=300,
                       json={**body, "messages": [{"role": "user", "content": q}]})
        return r.status_code, r.json()

    alone = [post(q) for q in questions]
    assert all(status == 200 for status, _ in alone)
    results: list = [None] * len(questions)

    def one(i):
        results[i] = post(questions[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    for (status, data), (_, ref) in zip(results, alone):
        assert status == 200, data
        assert data["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]


def test_a_stream_closed_early_frees_the_model(client, server):
    ref = ask(client, prompt("chat-focus"), max_tokens=24, extra_body=STRICT).choices[0].message.content
    with httpx.stream("POST", server + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": SMOL, "max_tokens": 200, "stream": True,
                            "messages": [{"role": "user", "content": prompt("story-robot")}]}, timeout=60) as r:
        lines = 0
        for line in r.iter_lines():
            lines += line.startswith("data: ")
            if lines >= 3:
                break                                 # the client goes away mid-stream
    t0 = time.monotonic()
    again = ask(client, prompt("chat-focus"), max_tokens=24, extra_body=STRICT).choices[0].message.content
    assert again == ref
    assert time.monotonic() - t0 < 60


def test_a_growing_conversation_reuses_the_cache(client):
    first = [{"role": "user", "content": prompt("chat-sky")}]
    a = client.chat.completions.create(model=SMOL, messages=first, max_tokens=16, extra_body=STRICT)
    second = first + [{"role": "assistant", "content": a.choices[0].message.content},
                      {"role": "user", "content": "And why is a sunset red?"}]
    b = client.chat.completions.create(model=SMOL, messages=second, max_tokens=16, extra_body=STRICT)
    assert b.usage.prompt_tokens_details.cached_tokens > a.usage.prompt_tokens // 2


def error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"}
    for w in words:
        assert w in json.dumps(e), e
    return e


def test_errors_have_their_status_and_openai_shape(server):
    url, auth = server + "/v1/chat/completions", {"Authorization": f"Bearer {KEY}"}
    msg = [{"role": "user", "content": "hi"}]
    error(httpx.post(url, json={"messages": msg}), 401, "API key")
    error(httpx.post(url, json={"messages": msg}, headers={"Authorization": "Bearer wrong"}), 401)
    error(httpx.post(url, json={"model": "nope", "messages": msg}, headers=auth), 404, "model_not_found")
    error(httpx.post(url, json={"messages": msg, "n": 2}, headers=auth), 400, "n must be 1")
    error(httpx.post(url, json={"messages": msg, "tools": []}, headers=auth), 400, "tools", "unsupported_field")
    error(httpx.post(url, json={"messages": msg, "logprobs": True}, headers=auth), 400, "logprobs")
    error(httpx.post(url, json={"messages": msg, "temperature": -1}, headers=auth), 400, "temperature")
    error(httpx.post(url, json={"messages": msg, "verifier": "loose"}, headers=auth), 400, "verifier")
    error(httpx.post(url, json={"messages": msg, "asd_budget": "nan"}, headers=auth), 400, "asd_budget")
    error(httpx.post(url, content=b"{not json", headers=auth), 400, "JSON")
    error(httpx.post(url, json={"messages": msg, "k": 100000}, headers=auth), 400, "batch-size")
    error(httpx.post(url, json={"messages": msg, "fly_window": 10**9}, headers=auth), 400)
    inf = httpx.post(url, content=b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, '
                                  b'"verifier": "asd", "asd_budget": Infinity}', headers=auth, timeout=120)
    assert inf.status_code == 200 and inf.json()["usage"]["flylocal"]["budget_left"] is None
    long = [{"role": "user", "content": "word " * (CTX + 50)}]
    error(httpx.post(url, json={"messages": long}, headers=auth), 400, "context_length_exceeded")
    error(httpx.post(url, content=b"x" * (5 << 20), headers={**auth, "Content-Type": "application/json"}), 413)
    error(httpx.get(server + "/v1/nothing-here", headers=auth), 404)
    # the server is unharmed
    ok = httpx.post(url, json={"messages": msg, "max_tokens": 4}, headers=auth, timeout=120)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


def test_a_full_queue_answers_503_with_retry_after():
    """--max-queue 0: the request running is the only one; another gets 503 at once."""
    port = free_port()
    proc = start("--target", SMOL, "--max-queue", "0", "--ctx", str(CTX), port=port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        long = {"messages": [{"role": "user", "content": prompt("story-robot")}], "max_tokens": 400, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=long, timeout=120) as running:
            next(running.iter_lines())                          # it holds the model now
            full = httpx.post(url + "/v1/chat/completions", json={**long, "stream": False}, timeout=30)
            error(full, 503, "queue_full")
            assert full.headers["retry-after"] == "1"
        page = httpx.get(url + "/metrics").text
        assert 'flylocal_requests_total{endpoint="chat",status="503"} 1.0' in page
        # SIGTERM with a stream in flight: the stream still ends properly, then the server exits 0.
        for _ in range(100):           # the stream closed above frees the model within a round
            with httpx.stream("POST", url + "/v1/chat/completions", json={**long, "max_tokens": 120},
                              timeout=120) as r:
                if r.status_code == 503:
                    time.sleep(0.05)
                    continue
                lines = r.iter_lines()
                next(lines)
                proc.send_signal(signal.SIGTERM)
                assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
                break
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_models_health_and_metrics(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(server + "/health").json() == {"status": "ready"}
    ids = [m["id"] for m in httpx.get(server + "/v1/models", headers=auth).json()["data"]]
    assert ids == [SMOL, SMOL_Q4_0]
    page = httpx.get(server + "/metrics", headers=auth).text
    for name in ("flylocal_requests_total", "flylocal_completion_tokens_total", "flylocal_drafted_tokens_total",
                 "flylocal_accepted_tokens_total", "flylocal_loose_tokens_total", "flylocal_mean_accepted_length",
                 "flylocal_queue_depth", "flylocal_time_to_first_token_seconds_bucket",
                 "flylocal_tokens_per_second_bucket"):
        assert name in page
    error(httpx.get(server + "/metrics"), 401)


def test_a_non_loopback_host_without_a_key_refuses_to_start():
    env = {k: v for k, v in os.environ.items() if k != "FLYLOCAL_API_KEY"}
    done = subprocess.run([sys.executable, "-m", "flylocal", "serve", "--host", "0.0.0.0", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--api-key" in lines[0], done.stderr


def test_a_port_in_use_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        done = subprocess.run([sys.executable, "-m", "flylocal", "serve", "--port", str(s.getsockname()[1])],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "cannot listen" in done.stderr
