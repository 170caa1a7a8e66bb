"""Several requests at once through `flylocal serve --parallel` (docs/design.md, "Several
requests at once"): real clients sending together get each its own answer, what the serial
server gives; a bounded load with random disconnects on loopback leaves every request answered
or refused with a clear status, no memory growth, and the server ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading
import time

import httpx
import pytest

from conftest import SMOL, SMOL_Q4_0, prompt
from test_server import free_port, served, start, stop, wait_ready

pytestmark = pytest.mark.slow

CTX = 1024
RETRIES = 100
QUESTIONS = [prompt(p) for p in ("qa-capital", "qa-planet", "qa-math", "qa-france", "chat-sky", "chat-focus",
                                 "poem-autumn", "story-robot")]
# A schema that references itself: its grammar fails once the request decodes (a 400 of its own).
SELF_REF = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
    "$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}}


@pytest.fixture(scope="module")
def two_servers():
    """The same models served one request at a time and four at once."""
    ports = free_port(), free_port()
    procs = [start("--target", SMOL, "--draft", SMOL_Q4_0, "--ctx", str(CTX), "--parallel", n, port=port)
             for n, port in zip(("1", "4"), ports)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        for proc, url in zip(procs, urls):
            wait_ready(proc, url)
        yield urls
    finally:
        for proc in procs:
            stop(proc)


def together(calls):
    """Run the calls at once (a thread each); their results in order."""
    out = [None] * len(calls)

    def run(i):
        out[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return out


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_real_clients_sent_together_get_the_serial_servers_answers(two_servers):
    """openai (chat, streamed and not), the ollama client and litellm, each strict at temperature
    0 for every drafter, sent at once to four slots: each answer is the serial server's."""
    import litellm
    import ollama
    from openai import OpenAI

    serial, slots = two_servers
    methods = [{"verifier": "strict", "drafter": d} for d in ("none", "pld", "model", "mla")]

    def calls(url):
        oa = OpenAI(base_url=url + "/v1", api_key="x", timeout=300, max_retries=0)
        ol = ollama.Client(host=url, timeout=300)
        out = []
        for i, method in enumerate(methods):
            q = QUESTIONS[i]
            out.append(lambda q=q, m=method: oa.chat.completions.create(
                model=SMOL, messages=[{"role": "user", "content": q}], max_tokens=24, temperature=0,
                extra_body=m).choices[0].message.content)
            out.append(lambda q=q, m=method: "".join(
                c.choices[0].delta.content or "" for c in oa.chat.completions.create(
                    model=SMOL, messages=[{"role": "user", "content": q}], max_tokens=24, temperature=0, stream=True,
                    extra_body=m) if c.choices))
        out.append(lambda: ol.chat(model=SMOL, messages=[{"role": "user", "content": QUESTIONS[5]}],
                                   options={"temperature": 0, "num_predict": 24}).message.content)
        out.append(lambda: litellm.completion(model=f"openai/{SMOL}", api_base=url + "/v1", api_key="x",
                                              messages=[{"role": "user", "content": QUESTIONS[6]}], max_tokens=24,
                                              temperature=0).choices[0].message.content)
        return out

    alone = [call() for call in calls(serial)]
    together: list = [None] * len(alone)

    def run(i, call):
        together[i] = call()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls(slots))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert together == alone
    health = httpx.get(slots + "/health").json()
    assert health == {"status": "ready", "slots": 4, "slots_busy": 0, "queued": 0}
    ps = httpx.get(slots + "/api/ps").json()["models"][0]["flylocal"]
    cache = ps.pop("prompt_cache")
    assert ps == {"role": "target", "slots": 4, "slots_busy": 0, "queued": 0}
    assert cache["limit_bytes"] > 0 and cache["bytes"] <= cache["limit_bytes"]


def test_busy_slots_show_in_health_and_a_full_queue_still_refuses():
    """Two slots, no queue: two requests sent at once both get in (a request a free slot takes
    is not waiting), two streams run together, a third request is refused with 503."""
    port = free_port()
    proc = start("--target", SMOL, "--ctx", str(CTX), "--parallel", "2", "--max-queue", "0", port=port)
    url = f"http://127.0.0.1:{port}"
    long = {"messages": [{"role": "user", "content": prompt("story-robot")}], "max_tokens": 300, "stream": True}
    try:
        wait_ready(proc, url)
        for burst in range(10):
            out = together([lambda q=q: httpx.post(url + "/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": q}], "max_tokens": 4}).status_code for q in QUESTIONS[:2]])
            assert out == [200, 200], f"burst {burst}: {out}"
        with httpx.stream("POST", url + "/v1/chat/completions", json=long, timeout=120) as a, \
                httpx.stream("POST", url + "/v1/chat/completions", json=long, timeout=120) as b:
            lines_a, lines_b = a.iter_lines(), b.iter_lines()
            next(lines_a), next(lines_b)
            for _ in range(3):
                next(line for line in lines_a if line.startswith("data: ") and '"content":"' in line)
                next(line for line in lines_b if line.startswith("data: ") and '"content":"' in line)
            health = httpx.get(url + "/health").json()
            assert health["slots"] == 2 and health["slots_busy"] == 2
            full = httpx.post(url + "/v1/chat/completions", json={**long, "stream": False}, timeout=30)
            assert full.status_code == 503 and full.json()["error"]["code"] == "queue_full"
        for _ in range(100):           # the closed streams free their slots within a round
            if httpx.get(url + "/health").json()["slots_busy"] == 0:
                break
            time.sleep(0.1)
        assert httpx.get(url + "/health").json()["slots_busy"] == 0
    finally:
        stop(proc)


def test_thirty_two_clients_three_hundred_requests_with_disconnects():
    """Loopback only, bounded in count and time: every request is answered or refused with a
    clear status (200, 400 for those whose grammar fails mid-batch, or 503 with Retry-After), the
    streams a client drops are let go, an embedding of 2,048 inputs whose client leaves stops,
    the server's memory does not grow past its first hundred requests, and it ends ready. With
    the fast kernels, the build users run."""
    port = free_port()
    exact = os.environ.get("FLYLOCAL_EXACT")
    os.environ["FLYLOCAL_EXACT"] = "0"            # the server process's build: the fast one
    try:
        proc = start("--target", SMOL, "--ctx", "512", "--parallel", "4", "--max-queue", "8", port=port)
    finally:
        if exact is None:
            del os.environ["FLYLOCAL_EXACT"]
        else:
            os.environ["FLYLOCAL_EXACT"] = exact
    url = f"http://127.0.0.1:{port}"
    rng = random.Random(44)
    plan = [(rng.choice(QUESTIONS), rng.randint(1, 12), rng.random() < 0.25, rng.random() < 0.5,
             rng.random() < 0.05) for _ in range(300)]
    statuses: list = []
    outcome: dict[int, tuple] = {}
    refused: list[int] = []
    rss: list[int] = []

    async def abandoned_embedding(client):
        with contextlib.suppress(httpx.TimeoutException):
            await client.post(url + "/v1/embeddings", timeout=1.0, json={
                "input": [f"sentence number {i} of a long list" for i in range(2048)]})

    async def attempt(client, body, drop, streamed):
        if streamed or drop:
            async with client.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as r:
                if r.status_code != 200:
                    return r.status_code, r.headers.get("retry-after")
                async for line in r.aiter_lines():
                    if drop and line.startswith("data: {"):
                        return "dropped", None           # the client goes away mid-stream
                return 200, None
        r = await client.post(url + "/v1/chat/completions", json=body)
        if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] not in ("stop", "length"):
            return "bad body", r.text
        return r.status_code, r.headers.get("retry-after")

    async def one(client, i, sem):
        q, n, drop, streamed, failing = plan[i]
        body = {"messages": [{"role": "user", "content": q}], "max_tokens": n, "stream": streamed,
                "verifier": "strict", "drafter": "pld"}
        if failing:                                  # its grammar fails once it decodes, beside the others
            body["response_format"] = SELF_REF
            body["stream"] = drop = streamed = False
        async with sem:
            try:
                for _ in range(RETRIES):            # as a client does: again after Retry-After (scaled down)
                    status = await attempt(client, body, drop, streamed)
                    if failing and status[0] == 400:
                        status = ("failed", None)
                    if status != (503, "1"):
                        break
                    refused.append(i)
                    await asyncio.sleep(rng.uniform(0.05, 0.3))
                statuses.append(status)
                outcome[i] = status
            except httpx.HTTPError as e:
                statuses.append(("error", repr(e)))
            if len(statuses) == 100:
                rss.append(rss_kib(proc.pid))

    async def main():
        sem = asyncio.Semaphore(32)
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.wait_for(asyncio.gather(abandoned_embedding(client),
                                                  *(one(client, i, sem) for i in range(300))), timeout=900)

    try:
        wait_ready(proc, url)
        asyncio.run(main())
        rss.append(rss_kib(proc.pid))
        assert len(statuses) == 300
        odd = [s for s in statuses if s[0] not in (200, "dropped", "failed") and s != (503, "1")]
        # A failing request fails with a 400, unless the queue stayed full through all its retries
        # (a busier machine): its grammar never decodes then. Nothing else fails.
        failing = [i for i, p in enumerate(plan) if p[4]]
        assert all(outcome[i][0] == "failed" or outcome[i] == (503, "1") for i in failing)
        assert sum(s[0] == "failed" for s in statuses) == sum(outcome[i][0] == "failed" for i in failing) > 0
        assert not odd, odd[:5]
        assert sum(1 for s in statuses if s[0] == 200) >= 150 and refused     # the queue filled, and emptied
        assert rss[-1] < rss[0] * 1.25 + 32 * 1024, rss
        for _ in range(100):
            health = httpx.get(url + "/health").json()
            if health["slots_busy"] == 0:
                break
            time.sleep(0.1)
        assert health == {"status": "ready", "slots": 4, "slots_busy": 0, "queued": 0}
        assert httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).status_code == 200
    finally:
        stop(proc)


# ----- company that fails, leaves, drafts with a model and embeds (exact build, --threads auto) -----

@pytest.fixture(scope="module")
def company():
    """Four slots with a draft model, on --threads auto (the default): the steered decodes of
    every slot's draft sequence."""
    yield from served("--target", SMOL, "--draft", SMOL_Q4_0, "--ctx", str(CTX), "--parallel", "4", "--threads", "auto")


def chat(url, content, timeout=300, **fields):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 24, "temperature": 0} | fields
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)
    return r.status_code, r.json()


def content(answer) -> str | None:
    return answer["choices"][0]["message"]["content"] if "choices" in answer else None


def hold(url, question, max_tokens, started: threading.Event, stop: threading.Event, chunks: list | None = None):
    """A stream holding a slot (end-of-generation banned): `started` at its first text, each
    chunk's time in `chunks`, gone once `stop` is set."""
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "stream": True,
            "logit_bias": {"2": -100}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                if chunks is not None:
                    chunks.append(time.perf_counter())
                started.set()
            if stop.is_set():
                return
    started.set()


@contextlib.contextmanager
def streams(url, questions, max_tokens):
    """Streams holding a slot each (`hold`) until the block ends; yields each one's chunk times,
    once every one has begun."""
    started = [threading.Event() for _ in questions]
    leave = threading.Event()
    chunks: list[list[float]] = [[] for _ in questions]
    holders = [threading.Thread(target=hold, args=(url, q, max_tokens, e, leave, c))
               for q, e, c in zip(questions, started, chunks)]
    for h in holders:
        h.start()
    try:
        assert all(e.wait(120) for e in started)
        yield chunks
    finally:
        leave.set()
        for h in holders:
            h.join(120)


def test_a_failing_grammar_fails_alone_and_the_server_goes_on(company):
    """Plain requests beside one, then four, whose schema references itself (a grammar that
    fails once decoding starts): each plain one answers as alone, each failing one is a 400,
    and the server answers afterwards."""
    alone = {q: content(chat(company, q, verifier="strict")[1]) for q in QUESTIONS[:3]}
    for failing in (1, 4):
        calls = [lambda q=q: chat(company, q, verifier="strict") for q in QUESTIONS[:3]]
        calls += [lambda: chat(company, "Give me JSON.", response_format=SELF_REF)] * failing
        out = together(calls)
        for q, (status, answer) in zip(QUESTIONS[:3], out):
            assert status == 200 and content(answer) == alone[q], (failing, answer)
        assert all(status == 400 and "a" in answer["error"]["message"] for status, answer in out[3:])
        status, _ = chat(company, "Hi", max_tokens=4, timeout=60)
        assert status == 200
    assert httpx.get(company + "/health").json()["status"] == "ready"


def test_a_draft_length_past_a_slots_share_is_refused_by_name(company):
    """k 511 fits --batch-size 512 but not a quarter of it: a 400 naming k and the bound, at
    once; k 127, a slot's whole share, is served beside another request."""
    status, answer = chat(company, "Hi", max_tokens=10, k=511, verifier="strict", timeout=60)
    assert status == 400 and answer["error"]["param"] == "k" and "at most 127" in answer["error"]["message"]
    out = together([lambda: chat(company, "Hi", max_tokens=10, k=127, verifier="strict", drafter="pld"),
                    lambda: chat(company, QUESTIONS[0], max_tokens=10)])
    assert [status for status, _ in out] == [200, 200]


@pytest.mark.parametrize("fields", [
    {"drafter": "model", "k": 6, "verifier": "fly", "fly_entropy": 0, "fly_window": 1},
    {"drafter": "model", "k": 6, "verifier": "fly", "temperature": 0.5, "seed": 11},
    {"drafter": "mla", "k": 6, "verifier": "strict"}], ids=["fly", "seeded", "mla"])
def test_a_draft_model_beside_a_long_request_gives_its_text_alone(company, fields):
    """With --threads auto, a request drafting with the draft model in slot 1 or up, beside a long
    request in slot 0, gives the text it gives alone (a draft step on another slot's sequence
    would change its drafts, and a loose or seeded answer with them), with the same acceptance."""
    alone = chat(company, prompt("qa-france"), max_tokens=48, **fields)[1]
    with streams(company, [prompt("story-robot")], 400):
        beside = chat(company, prompt("qa-france"), max_tokens=48, **fields)[1]
    assert content(beside) == content(alone)
    assert beside["usage"]["flylocal"]["accepted"] == alone["usage"]["flylocal"]["accepted"]


def test_embeddings_share_the_worker_and_stop_when_their_client_leaves(company):
    """An embedding request runs between rounds: one string beside four busy slots is answered
    while every stream still runs; 600 inputs beside three streams leave them streaming; 2,048
    inputs whose client leaves stop, and a chat sent next is answered."""
    sentence = "The quick brown fox jumps over the lazy dog near the river bank in the morning light."
    with streams(company, QUESTIONS[:4], 300):
        r = httpx.post(company + "/v1/embeddings", json={"input": sentence}, timeout=120)
        assert r.status_code == 200
        assert httpx.get(company + "/health").json()["slots_busy"] == 4      # no stream had to end first
    with streams(company, QUESTIONS[:3], 400) as chunks:
        t0 = time.perf_counter()
        r = httpx.post(company + "/v1/embeddings", json={"input": [f"{sentence} {i}" for i in range(600)]},
                       timeout=600)
        t1 = time.perf_counter()
        assert r.status_code == 200 and len(r.json()["data"]) == 600
        during = [sum(t0 < t < t1 for t in c) for c in chunks]
        assert all(n > 0 for n in during), during                # every stream went on meanwhile
    with pytest.raises(httpx.TimeoutException):
        httpx.post(company + "/v1/embeddings", json={"input": [f"{sentence} {i}" for i in range(2048)]}, timeout=1.5)
    t0 = time.perf_counter()
    status, _ = chat(company, "Hi", max_tokens=4, timeout=300)
    assert status == 200
    # 2,048 inputs take minutes here; stopped at the client's leaving, the chat waits a decode or two
    assert time.perf_counter() - t0 < 60
    assert httpx.get(company + "/health").json() == {"status": "ready", "slots": 4, "slots_busy": 0, "queued": 0}


def test_random_company_every_survivor_is_its_run_alone(company):
    """Random company, exact build: strict requests with every drafter, seeded ones at
    temperature 0.7, loose ones at a given k, requests whose grammar fails, streams whose client
    leaves, and embeddings, sent together in waves: every request that is not failed or left
    gives its text alone, every failure is a 400 of its own, and the server answers afterwards."""
    rng = random.Random(53)
    kinds = {
        "strict-none": dict(verifier="strict", drafter="none"), "strict-pld": dict(verifier="strict", drafter="pld"),
        "strict-model": dict(verifier="strict", drafter="model"), "strict-mla": dict(verifier="strict", drafter="mla"),
        "seeded": dict(verifier="strict", drafter="pld", temperature=0.7, seed=5, k=5),
        "fly-model": dict(verifier="fly", drafter="model", k=5, fly_entropy=0.1),
    }
    questions = QUESTIONS[:4]
    alone = {(name, q): content(chat(company, q, max_tokens=32, **fields)[1])
             for name, fields in kinds.items() for q in questions}
    for wave in range(6):
        calls, expected = [], []
        for _ in range(rng.randint(3, 7)):
            what = rng.random()
            if what < 0.65:
                name, q = rng.choice(list(kinds)), rng.choice(questions)
                calls.append(lambda name=name, q=q: chat(company, q, max_tokens=32, **kinds[name]))
                expected.append(("answer", alone[(name, q)]))
            elif what < 0.8:
                calls.append(lambda: chat(company, "JSON please.", response_format=SELF_REF))
                expected.append(("failed", None))
            elif what < 0.9:
                def leave(q=rng.choice(questions)):
                    e, gone = threading.Event(), threading.Event()
                    gone.set()
                    hold(company, q, 200, e, gone)           # leaves at its first line
                    return "left", None
                calls.append(leave)
                expected.append(("left", None))
            else:
                n = rng.randint(1, 300)
                calls.append(lambda n=n: (httpx.post(company + "/v1/embeddings", timeout=300, json={
                    "input": [f"line {i}" for i in range(n)]}).status_code, None))
                expected.append(("embedded", None))
        out = together(calls)
        for (kind, text), got in zip(expected, out):
            status, answer = got
            if kind == "answer":
                assert status == 200 and content(answer) == text, (wave, answer, text)
            elif kind == "failed":
                assert status == 400, (wave, answer)
            elif kind == "embedded":
                assert status == 200
    assert chat(company, "Hi", max_tokens=4, timeout=60)[0] == 200
