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
import numpy as np
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
    """A server whose stderr (a log line a request) goes to a file, read back by `log(proc)`."""
    import tempfile

    err = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-m", "flylocal", "serve", "--port", str(port), "--threads", "1", *args],
                            stdout=subprocess.DEVNULL, stderr=err, text=True)
    proc.log_file = err
    return proc


def served(*args: str):
    """A server started with `args` on a free port: its URL once it answers; stopped afterwards
    (a generator for a module fixture: `yield from served(...)`)."""
    port = free_port()
    proc = start(*args, port=port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        yield url
    finally:
        stop(proc)


def log(proc: subprocess.Popen) -> str:
    proc.log_file.seek(0)
    return proc.log_file.read()


def wait_ready(proc: subprocess.Popen, url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited: {log(proc)}")
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
        url_of[url] = proc
        yield url
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, as a service manager stops a server: it ends within a minute, with exit 0."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, log(proc)


url_of: dict[str, subprocess.Popen] = {}           # a running server's process, by its URL


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
    assert mine["draft_context"]["chosen"] in ("full", "window", "lookup")    # what the draft model read
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
    error(httpx.post(url, json={"messages": msg, "tools": [{"type": "function"}]}, headers=auth), 400,
          "tools[0]: a tool is")
    error(httpx.post(url, json={"messages": msg, "functions": []}, headers=auth), 400, "functions", "unsupported_field")
    error(httpx.post(url, json={"messages": msg, "temperature": -1}, headers=auth), 400, "temperature")
    error(httpx.post(url, json={"messages": msg, "verifier": "loose"}, headers=auth), 400, "verifier")
    error(httpx.post(url, json={"messages": msg, "asd_budget": "nan"}, headers=auth), 400, "asd_budget")
    error(httpx.post(url, content=b"{not json", headers={**auth, "Content-Type": "application/json"}), 400, "JSON")
    error(httpx.post(url, content=b"{not json", headers={**auth, "Content-Type": "text/plain"}), 415, "application/json")
    error(httpx.post(url, content=b"{not json", headers=auth), 400, "JSON")    # no Content-Type: read as JSON
    e = error(httpx.post(url, json={"messages": msg, "k": 100000}, headers=auth), 400, "batch-size")
    assert e["param"] == "k" and e["message"].count("k 100000") == 1
    # Across rounds (the default) a window is held to a slot's share as a draft is: past it, a
    # 400 naming fly_window and its bound (was taken with a slot's share of 127).
    e = error(httpx.post(url, json={"messages": msg, "fly_window": 200, "max_tokens": 4}, headers=auth), 400,
              "fly_window 200")
    assert e["param"] == "fly_window" and e["message"].endswith("at most 127")
    wide = httpx.post(url, json={"messages": msg, "fly_window": 127, "max_tokens": 4}, headers=auth, timeout=120)
    assert wide.status_code == 200, wide.text
    e = error(httpx.post(url, json={"messages": msg, "stop": 5}, headers=auth), 400)
    assert e["param"] == "stop" and e["message"].count("stop") == 1
    inf = httpx.post(url, content=b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, '
                                  b'"verifier": "asd", "asd_budget": Infinity}',
                     headers={**auth, "Content-Type": "application/json"}, timeout=120)
    assert inf.status_code == 200 and inf.json()["usage"]["flylocal"]["budget_left"] is None
    long = [{"role": "user", "content": "word " * (CTX + 50)}]
    error(httpx.post(url, json={"messages": long}, headers=auth), 400, "context_length_exceeded")
    error(httpx.post(url, content=b"x" * (5 << 20), headers={**auth, "Content-Type": "application/json"}), 413)
    error(httpx.get(server + "/v1/nothing-here", headers=auth), 404)
    # the server is unharmed
    ok = httpx.post(url, json={"messages": msg, "max_tokens": 4}, headers=auth, timeout=120)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


def test_a_full_queue_answers_503_with_retry_after():
    """--max-queue 0 with one slot: the request running is the only one; another gets 503 at once."""
    port = free_port()
    proc = start("--target", SMOL, "--max-queue", "0", "--parallel", "1", "--ctx", str(CTX), port=port)
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
    assert httpx.get(server + "/health").json() == {"status": "ready", "slots": 4, "slots_busy": 0, "queued": 0}
    listed = httpx.get(server + "/v1/models", headers=auth).json()["data"]
    assert [m["id"] for m in listed] == [SMOL] and listed[0]["flylocal"] == {"role": "target", "draft": SMOL_Q4_0}
    page = httpx.get(server + "/metrics", headers=auth).text
    for name in ("flylocal_requests_total", "flylocal_completion_tokens_total", "flylocal_drafted_tokens_total",
                 "flylocal_accepted_tokens_total", "flylocal_loose_tokens_total", "flylocal_mean_accepted_length",
                 "flylocal_queue_depth", "flylocal_time_to_first_token_seconds_bucket",
                 "flylocal_tokens_per_second_bucket", "flylocal_slots 4.0", "flylocal_slots_busy 0.0",
                 "flylocal_queue_wait_seconds_bucket"):
        assert name in page
    error(httpx.get(server + "/metrics"), 401)


def test_a_non_loopback_host_without_a_key_refuses_to_start():
    env = {k: v for k, v in os.environ.items() if k != "FLYLOCAL_API_KEY"}
    done = subprocess.run([sys.executable, "-m", "flylocal", "serve", "--host", "0.0.0.0", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--api-key" in lines[0], done.stderr


@pytest.mark.parametrize("args,said", [
    (["--cache-share", "key"], "--cache-share key needs --api-key or --api-key-file"),
    (["--api-key-file", "/nonexistent/keys"], "cannot read --api-key-file /nonexistent/keys"),
])
def test_bad_key_options_are_one_line_before_anything_loads(args, said):
    env = {k: v for k, v in os.environ.items() if k != "FLYLOCAL_API_KEY"}
    done = subprocess.run([sys.executable, "-m", "flylocal", "serve", "--port", str(free_port()), *args],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], done.stderr


def test_a_port_in_use_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        done = subprocess.run([sys.executable, "-m", "flylocal", "serve", "--port", str(s.getsockname()[1])],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "cannot listen" in done.stderr


# ----- what real clients send, and what web pages cannot -----

def test_a_front_end_sending_do_nothing_values_gets_the_same_answer(client):
    plain = ask(client, prompt("qa-planet"), extra_body=STRICT).choices[0].message.content
    sliders = ask(client, prompt("qa-planet"), frequency_penalty=0, presence_penalty=0, user="u-17", n=1,
                  logprobs=False, response_format={"type": "text"}, tools=[], tool_choice="none",
                  parallel_tool_calls=False, logit_bias={}, store=False, metadata={}, service_tier="auto",
                  extra_body=STRICT).choices[0].message.content
    assert sliders == plain
    named = client.chat.completions.create(model=SMOL, max_tokens=32, extra_body=STRICT,
                                           messages=[{"role": "user", "content": prompt("qa-planet"), "name": "ann"}])
    assert named.choices[0].message.content == plain


def test_logprobs_are_the_plain_decodes_and_mark_how_each_token_came(client):
    """Strict at temperature 0 in exact mode: each token's logprob is the one a plain decode of
    the same text gives, its top_logprobs are sorted and start with it."""
    from flylocal.llama.runtime import Runtime, RuntimeConfig

    from conftest import model_path

    messages = [{"role": "user", "content": prompt("summarise-council")}]
    answer = client.chat.completions.create(model=SMOL, messages=messages, max_tokens=24, logprobs=True,
                                            top_logprobs=3, extra_body={"verifier": "strict", "drafter": "pld"})
    entries = answer.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == answer.choices[0].message.content
    with Runtime(model_path(SMOL), RuntimeConfig(n_ctx=CTX, n_threads=1)) as rt:
        ids = rt.tokenize_chat(messages)
        rt.decode(ids[:-1])
        last = int(ids[-1])
        for e in entries:
            z = rt.decode([last], logits_from=0)[0].astype(np.float64)
            lse = z.max() + np.log(np.exp(z - z.max()).sum())
            token = int(z.argmax())
            assert bytes(e.bytes) == rt.piece(token)
            assert e.logprob == pytest.approx(z[token] - lse, abs=1e-4)
            assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
            assert e.top_logprobs[0].token == e.token and len(e.top_logprobs) == 3
            assert e.model_extra["flylocal"]["kind"] in ("accepted", "target")      # strict: never loose
            last = token
    kinds = [e.model_extra["flylocal"]["kind"] for e in entries]
    assert kinds.count("accepted") == answer.usage.model_extra["flylocal"]["accepted"]
    streamed = [e for c in client.chat.completions.create(
        model=SMOL, messages=messages, max_tokens=24, logprobs=True, top_logprobs=1, stream=True,
        extra_body={"verifier": "strict"}) if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-4)
    text = client.completions.create(model=SMOL, prompt="The capital of France is", max_tokens=6, logprobs=2,
                                     extra_body=STRICT)
    lp = text.choices[0].logprobs
    assert "".join(lp.tokens) == text.choices[0].text and len(lp.token_logprobs) == len(lp.tokens)
    assert all(len(top) == 2 for top in lp.top_logprobs)


def test_loose_tokens_are_marked_and_carry_the_targets_own_logprob(client):
    answer = client.chat.completions.create(
        model=SMOL, messages=[{"role": "user", "content": prompt("copy-edit-letter")}], max_tokens=96, logprobs=True,
        top_logprobs=2, extra_body={"verifier": "fly", "drafter": "model", "k": 8, "fly_entropy": 0.0})
    entries = answer.choices[0].logprobs.content
    loose = [e for e in entries if e.model_extra["flylocal"]["kind"] == "loose"]
    assert len(loose) == answer.usage.model_extra["flylocal"]["loose"]
    for e in loose:                         # the target preferred another token there
        assert e.top_logprobs[0].logprob >= e.logprob and e.top_logprobs[0].token != e.token


def test_each_streamed_chunk_says_how_its_tokens_came_and_where_they_end(client):
    """The stream's extension (docs/serving.md, "Server"): a letter per token, in the order of the
    chunk's logprobs entries, and each token's characters, which cut the joined text into the
    tokens' own text; a stop string's cut leaves the tokens it cut out."""
    def stream(**extra):
        chunks = list(client.chat.completions.create(
            model=SMOL, messages=[{"role": "user", "content": prompt("chat-focus")}], max_tokens=64,
            logprobs=True, top_logprobs=1, stream=True, stream_options={"include_usage": True},
            extra_body={"verifier": "fly", "drafter": "model", "k": 10}, **extra))
        text, kinds, chars, entries = "", "", [], []
        for c in chunks:
            ext = (c.model_extra or {}).get("flylocal")
            if c.choices and c.choices[0].delta.content:
                text += c.choices[0].delta.content
            if ext:
                assert len(ext["kinds"]) == len(ext["chars"]) == len(c.choices[0].logprobs.content)
                kinds += ext["kinds"]
                chars += ext["chars"]
                entries += c.choices[0].logprobs.content
        return text, kinds, chars, entries, chunks[-1].usage

    text, kinds, chars, entries, usage = stream()
    mine = usage.model_extra["flylocal"]
    assert len(kinds) == usage.completion_tokens and set(kinds) <= set("ALT")
    assert kinds.count("L") == mine["loose"] and kinds.count("A") + kinds.count("L") == mine["accepted"]
    assert kinds == "".join({"accepted": "A", "loose": "L", "target": "T"}[e.model_extra["flylocal"]["kind"]]
                            for e in entries)
    assert sum(chars) == len(text)
    ends = np.cumsum(chars)
    pieces = [text[a:b] for a, b in zip([0, *ends[:-1]], ends)]
    assert "".join(bytes(e.bytes).decode("utf-8", "replace") for e in entries) == text
    for piece, e in zip(pieces, entries):    # a token's characters are its own text (whole characters here)
        assert piece == bytes(e.bytes).decode("utf-8", "replace")
    # A stop string inside the answer: the text ends before it, and the tokens it cut are not sent.
    stop = next(p for p in pieces[10:] if len(p.strip()) >= 3)
    cut_text, cut_kinds, cut_chars, _, _ = stream(stop=[stop])
    assert cut_text == text[: text.index(stop)]
    assert sum(cut_chars) == len(cut_text) and cut_kinds == kinds[: len(cut_kinds)]


def test_a_stop_string_inside_a_token_ends_text_and_tokens_together(server):
    """A stop string that begins and ends inside tokens (docs/serving.md, "Server"): the text is cut
    where it begins; the answer's tokens end with the one that completes it, and logprobs,
    usage, the streamed chars and Ollama's context all count those tokens."""
    question, checked = "List five fruits, one per line.", 0
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": 48, "temperature": 0,
            "verifier": "strict", "logprobs": True}
    full = httpx.post(server + "/v1/chat/completions", headers=headers, json=body, timeout=120).json()
    entries = full["choices"][0]["logprobs"]["content"]
    pieces = [bytes(e["bytes"]).decode("utf-8", "replace") for e in entries]
    text = "".join(pieces)
    at = 0
    for i, piece in enumerate(pieces):          # stop strings that end inside a token of 3 characters or more
        at += len(piece)
        if len(piece.strip()) < 3 or i < 2:
            continue
        stop = piece.strip()[1:-1]                    # inside this token
        begin = text.find(stop)
        end = begin + len(stop)
        kept = next(j + 1 for j, e in enumerate(np.cumsum([len(p) for p in pieces])) if e >= end)
        whole = httpx.post(server + "/v1/chat/completions", headers=headers, json=body | {"stop": [stop]},
                           timeout=120).json()
        answer = whole["choices"][0]
        assert answer["message"]["content"] == text[:begin], stop
        assert whole["usage"]["completion_tokens"] == len(answer["logprobs"]["content"]) == kept, stop
        assert [e["token"] for e in answer["logprobs"]["content"]] == [e["token"] for e in entries[:kept]]
        streamed, chars = "", 0
        with httpx.stream("POST", server + "/v1/chat/completions", headers=headers,
                          json=body | {"stop": [stop], "stream": True, "logprobs": False}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    data = json.loads(line[6:])
                    chars += sum((data.get("flylocal") or {}).get("chars", []))
                    if data["choices"]:
                        streamed += data["choices"][0]["delta"].get("content") or ""
        assert streamed == text[:begin] and chars == len(streamed), stop
        generated = httpx.post(server + "/api/generate", headers=headers, json={
            "model": SMOL, "prompt": question, "stream": False, "verifier": "strict",
            "options": {"temperature": 0, "num_predict": 48, "stop": [stop]}}, timeout=120).json()
        made = len(generated["context"]) - full["usage"]["prompt_tokens"]      # the same prompt, templated alike
        assert generated["response"] == text[:begin] and made == generated["eval_count"] == kept, stop
        checked += 1
        if checked == 3:
            break
    assert checked == 3


def test_a_client_that_leaves_is_logged_as_499(server):
    before = log(url_of[server]).count("\n")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=0.3, json={
            "messages": [{"role": "user", "content": prompt("story-robot")}], "max_tokens": 400})
    for _ in range(100):
        lines = [line for line in log(url_of[server]).splitlines()[before:] if "/v1/chat/completions" in line]
        if lines:
            break
        time.sleep(0.1)
    assert lines and " 499 " in lines[-1], lines


def test_penalties_change_greedy_output_as_in_flylocal_generate(client):
    kw = {"frequency_penalty": 1.5, "presence_penalty": 1.0}
    answer = ask(client, prompt("story-robot"), max_tokens=40, extra_body=STRICT, **kw).choices[0].message.content
    assert answer != ask(client, prompt("story-robot"), max_tokens=40, extra_body=STRICT).choices[0].message.content
    done = subprocess.run([sys.executable, "-m", "flylocal", "generate", prompt("story-robot"), "--verifier", "strict",
                           "--max-tokens", "40", "--json", "--ctx", str(CTX), "--threads", "1",
                           "--frequency-penalty", "1.5", "--presence-penalty", "1.0"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["text"] == answer
    first = out["tokens"][0]                 # ban the first token of the answer: it must not come
    banned = ask(client, prompt("story-robot"), max_tokens=8, extra_body=STRICT, logit_bias={str(first): -100},
                 **kw).choices[0].message.content
    again = subprocess.run([sys.executable, "-m", "flylocal", "generate", prompt("story-robot"), "--verifier", "strict",
                            "--max-tokens", "1", "--json", "--ctx", str(CTX), "--threads", "1"],
                           capture_output=True, text=True, timeout=300)
    assert banned and not banned.startswith(json.loads(again.stdout)["text"])


def test_litellm_langchain_and_the_llm_command_line_get_answers(server, tmp_path):
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"     # no fetch of litellm's price list
    import litellm
    from langchain_openai import ChatOpenAI

    question = [{"role": "user", "content": prompt("qa-capital")}]
    via_litellm = litellm.completion(model=f"openai/{SMOL}", api_base=server + "/v1", api_key=KEY, messages=question,
                                     max_tokens=16, temperature=0, extra_body=STRICT)
    assert via_litellm.choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in litellm.completion(
        model=f"openai/{SMOL}", api_base=server + "/v1", api_key=KEY, messages=question, max_tokens=16,
        temperature=0, stream=True, extra_body=STRICT))
    assert streamed == via_litellm.choices[0].message.content
    chat = ChatOpenAI(model=SMOL, base_url=server + "/v1", api_key=KEY, max_tokens=16, temperature=0,
                      extra_body=STRICT, max_retries=0, timeout=120)
    assert chat.invoke(prompt("qa-capital")).content == via_litellm.choices[0].message.content
    assert "".join(c.content for c in chat.stream(prompt("qa-capital"))) == via_litellm.choices[0].message.content
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: flylocal\n  model_name: {SMOL}\n  api_base: {server}/v1\n  api_key_name: flylocal\n")
    (tmp_path / "keys.json").write_text(json.dumps({"flylocal": KEY}))
    done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "llm"), "-m", "flylocal", "-o", "max_tokens",
                           "16", "-o", "temperature", "0", "--no-log", prompt("qa-capital")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "LLM_USER_PATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()


def test_the_ollama_client_chats_generates_and_lists(server):
    import ollama

    client = ollama.Client(host=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    names = [m.model for m in client.list().models]
    assert names == [SMOL]
    options = {"num_predict": 24, "temperature": 0, "num_ctx": CTX}
    question = [{"role": "user", "content": prompt("qa-capital")}]
    whole = client.chat(model=SMOL, messages=question, options=options, stream=False)
    assert whole.message.content and whole.done and whole.done_reason in ("stop", "length")
    assert whole.eval_count > 0 and whole.prompt_eval_count > 0 and whole.total_duration > 0
    pieces = list(client.chat(model=f"{SMOL}:latest", messages=question, options=options, stream=True))
    assert "".join(p.message.content for p in pieces) == whole.message.content and pieces[-1].done
    openai_answer = httpx.post(server + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                               json={"messages": question, "max_tokens": 24, "temperature": 0}, timeout=120)
    assert openai_answer.json()["choices"][0]["message"]["content"] == whole.message.content
    made = client.generate(model=SMOL, prompt="The capital of France is", raw=True, options=options)
    assert made.response and made.done
    assert "".join(p.response for p in client.generate(model=SMOL, prompt="The capital of France is", raw=True,
                                                        options=options, stream=True)) == made.response
    shown = client.show(SMOL)
    assert shown.details.family == "llama" and shown.details.format == "gguf"
    assert client.ps().models[0].model == SMOL
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="llama3", messages=question)
    assert e.value.status_code == 404
    wished = client.chat(model=SMOL, messages=question, options={**options, "num_ctx": CTX * 4})
    assert wished.message.content == whole.message.content       # a wish: the server's context serves it
    assert f"num_ctx                        {CTX}" in shown.parameters.splitlines()
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("llama3")               # pulls only what models.txt names: never another registry's
    assert e.value.status_code == 404 and "not in flylocal's models.txt" in e.value.error
    version = httpx.get(server + "/api/version", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert version["version"]


def generations(server) -> float:
    page = httpx.get(server + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return float(next(line.split()[-1] for line in page.splitlines() if line.startswith("flylocal_generations_total")))


def test_web_pages_cannot_drive_it_and_no_generation_runs(server):
    before = generations(server)
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}).encode()
    auth = {"Authorization": f"Bearer {KEY}"}
    simple = httpx.post(server + "/v1/chat/completions", content=body,
                        headers={**auth, "Content-Type": "text/plain", "Origin": "http://evil.example"})
    assert simple.status_code == 403
    plain = httpx.post(server + "/v1/chat/completions", content=body, headers={**auth, "Content-Type": "text/plain"})
    assert plain.status_code == 415
    rebound = httpx.get(server + "/v1/models", headers={**auth, "Host": "evil.example:8150"})
    assert rebound.status_code == 403
    rebound_chat = httpx.post(server.replace("127.0.0.1", "localhost") + "/api/chat", headers={
        **auth, "Host": "evil.example"}, json={"model": SMOL, "messages": [{"role": "user", "content": "hi"}]})
    assert rebound_chat.status_code == 403
    assert generations(server) == before                    # nothing ran
    same_origin = httpx.post(server + "/v1/chat/completions", content=body, timeout=120,    # may measure costs first
                             headers={**auth, "Content-Type": "application/json", "Origin": server})
    assert same_origin.status_code == 200
    assert generations(server) == before + 1
    lines = log(url_of[server]).splitlines()
    assert any(line.startswith("flylocal: POST /v1/chat/completions 200 prompt ") and "tok/s" in line
               for line in lines), lines[-5:]
    assert any("POST /v1/chat/completions 403 refused (bad_origin)" in line for line in lines), lines[-5:]
    assert any("GET /v1/models 403 refused (bad_host)" in line for line in lines), lines[-5:]
