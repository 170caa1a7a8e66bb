"""Several requests at once through `flylocal serve --parallel` (docs/design.md, "Several
requests at once"): real clients sending together get each its own answer, what the serial
server gives; a bounded load with random disconnects on loopback leaves every request answered
or refused with a clear status, no memory growth, and the server ready.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time

import httpx
import pytest

from conftest import SMOL, SMOL_Q4_0, prompt
from test_server import free_port, start, stop, wait_ready

pytestmark = pytest.mark.slow

CTX = 1024
RETRIES = 100
QUESTIONS = [prompt(p) for p in ("qa-capital", "qa-planet", "qa-math", "qa-france", "chat-sky", "chat-focus",
                                 "poem-autumn", "story-robot")]


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
    assert ps == {"slots": 4, "slots_busy": 0, "queued": 0}


def test_busy_slots_show_in_health_and_a_full_queue_still_refuses():
    """Two slots, no queue: two streams run together, a third request is refused with 503."""
    port = free_port()
    proc = start("--target", SMOL, "--ctx", str(CTX), "--parallel", "2", "--max-queue", "0", port=port)
    url = f"http://127.0.0.1:{port}"
    long = {"messages": [{"role": "user", "content": prompt("story-robot")}], "max_tokens": 300, "stream": True}
    try:
        wait_ready(proc, url)
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
    clear status (200, or 503 with Retry-After), the streams a client drops are let go, the
    server's memory does not grow past its first hundred requests, and it ends ready. With the
    fast kernels, the build users run: its sequences share one unified cache."""
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
    plan = [(rng.choice(QUESTIONS), rng.randint(1, 12), rng.random() < 0.25, rng.random() < 0.5)
            for _ in range(300)]
    statuses: list = []
    refused: list[int] = []
    rss: list[int] = []

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
        q, n, drop, streamed = plan[i]
        body = {"messages": [{"role": "user", "content": q}], "max_tokens": n, "stream": streamed,
                "verifier": "strict", "drafter": "pld"}
        async with sem:
            try:
                for _ in range(RETRIES):            # as a client does: again after Retry-After (scaled down)
                    status = await attempt(client, body, drop, streamed)
                    if status != (503, "1"):
                        break
                    refused.append(i)
                    await asyncio.sleep(rng.uniform(0.05, 0.3))
                statuses.append(status)
            except httpx.HTTPError as e:
                statuses.append(("error", repr(e)))
            if len(statuses) == 100:
                rss.append(rss_kib(proc.pid))

    async def main():
        sem = asyncio.Semaphore(32)
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.wait_for(asyncio.gather(*(one(client, i, sem) for i in range(300))), timeout=900)

    try:
        wait_ready(proc, url)
        asyncio.run(main())
        rss.append(rss_kib(proc.pid))
        assert len(statuses) == 300
        odd = [s for s in statuses if s[0] not in (200, "dropped") and s != (503, "1")]
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
