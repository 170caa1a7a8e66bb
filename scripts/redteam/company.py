#!/usr/bin/env python3
"""Red team of `flylocal serve` in company (several requests at once; issue "Several requests at
once, safely"): hostile and ordinary requests sent together to real servers on loopback, each
case judged good or bad, counted per group.

Groups (a case is one request judged, or one burst's follow-up request):
  grammar    3 plain chats with 1 or 4 requests whose schema references itself, sent together to
             --parallel 4: the plain ones answer as alone, the bad ones 400, and the server answers
             afterwards
  k          a draft length at or past what a slot holds (k 511, 300, 128, 127 at --batch-size 512;
             63, 62, 15 at --batch-size 64), beside a plain request: every request is answered
             (200 or a 400) within 60 s
  draft      a draft model (--threads auto) with FLy at a given k, and a seeded one at temperature
             0.5, beside a 400-token request in slot 0 and alone: the same text
  embed      an abandoned 2,048-input embedding, then a chat (answered within 20 s); 600 inputs
             beside 3 streams (no stream waits 2 s between chunks); one string beside 4 streams
             (answered within 1.5 s)
  admission  --parallel 2 --max-queue 0, two requests at once, 20 times: never a 503
  stop       a stop string ending inside a token: text, logprobs, usage, streamed chars and
             Ollama's context agree
  canary     the same seeded request (temperature 0.5, seed 11) and a strict one, alone and then
             30 times each (--canary N) beside random company and embeddings: the same text
  gone       a client that leaves a non-streamed request: its log line says 499

    .venv/bin/python scripts/redteam/company.py [--tree PATH] [--exact] [--groups a,b] [--json OUT]

`--tree PATH` runs the servers from another checkout of flylocal (PYTHONPATH=PATH), to measure
an earlier version with the same cases. `--exact` runs them in the exact build.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
TARGET = "smollm2-135m-instruct"
DRAFT = "smollm2-135m-instruct-q4_0"
SELF_REF = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
    "$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}}
QUESTIONS = ["What is the capital of France?", "Name a planet.", "What is 2 + 2?", "Why is the sky blue?",
             "Give me a word that rhymes with cat.", "What colour is grass?"]
LONG = "Write a long story about a robot who learns to paint. Describe every day of its life."


class Server:
    def __init__(self, args: list[str], tree: str | None, exact: bool):
        from socket import socket

        with socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, FLYLOCAL_EXACT="1" if exact else "0")
        if tree:
            env["PYTHONPATH"] = tree
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "flylocal", "serve", "--port", str(self.port),
                                      "--target", TARGET, *args], stdout=self.log, stderr=self.log, env=env,
                                     cwd=tree or ROOT)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited: {self.text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the server did not become ready")
            time.sleep(0.25)

    def text(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Tally:
    def __init__(self):
        self.groups: dict[str, list] = {}

    def case(self, group: str, ok: bool, what: str) -> None:
        self.groups.setdefault(group, []).append((ok, what))
        print(f"  {'ok ' if ok else 'BAD'} {group}: {what}", flush=True)

    def table(self) -> dict:
        return {g: {"tried": len(c), "bad": sum(not ok for ok, _ in c),
                    "first_bad": next((w for ok, w in c if not ok), None)} for g, c in self.groups.items()}


def chat(url: str, content: str, timeout: float = 60, **fields) -> tuple[int | str, dict | str]:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 24, "temperature": 0} | fields
    try:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)
    except httpx.TimeoutException:
        return "timeout", ""
    except httpx.HTTPError as e:
        return "error", repr(e)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


def text_of(answer) -> str | None:
    return answer["choices"][0]["message"]["content"] if isinstance(answer, dict) and "choices" in answer else None


def together(calls):
    with cf.ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda c: c(), calls))


def hold_stream(url: str, content: str, max_tokens: int, started: threading.Event, gaps: list | None = None,
                stop: threading.Event | None = None):
    """A streamed chat that holds a slot; `started` is set at its first text; the gaps between its
    chunks go to `gaps`; it leaves when `stop` is set."""
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "logit_bias": {"2": -100}}
    last = None
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    now = time.perf_counter()
                    if last is not None and gaps is not None:
                        gaps.append(now - last)
                    last = now
                    started.set()
                if stop is not None and stop.is_set():
                    return
    except httpx.HTTPError:
        started.set()


# ----- the groups -----

def grammar(t: Tally, make) -> None:
    s = make(["--parallel", "4", "--ctx", "1024"])
    try:
        alone = {q: text_of(chat(s.url, q, verifier="strict")[1]) for q in QUESTIONS[:3]}
        for burst in range(6):
            bad = 1 if burst % 2 == 0 else 4
            calls = [lambda q=q: chat(s.url, q, verifier="strict") for q in QUESTIONS[:3]]
            calls += [lambda: chat(s.url, "Give me JSON.", response_format=SELF_REF) for _ in range(bad)]
            out = together(calls)
            for q, (status, answer) in zip(QUESTIONS[:3], out[:3]):
                t.case("grammar", status == 200 and text_of(answer) == alone[q],
                       f"burst {burst}: plain beside {bad} failing -> {status} {str(text_of(answer) or answer)[:60]!r}")
            for status, answer in out[3:]:
                t.case("grammar", status == 400, f"burst {burst}: the self-referencing schema -> {status}")
            status, answer = chat(s.url, "Hi", max_tokens=4, timeout=60)
            t.case("grammar", status == 200, f"burst {burst}: a request afterwards -> {status}")
            if status != 200:
                s.stop()
                s = make(["--parallel", "4", "--ctx", "1024"])
    finally:
        s.stop()


def draft_length(t: Tally, make) -> None:
    for batch, ks in (("512", (511, 300, 128, 127)), ("64", (63, 62, 15))):
        s = make(["--parallel", "4", "--ctx", "1024", "--batch-size", batch])
        try:
            for k in ks:
                out = together([lambda: chat(s.url, "Hi", max_tokens=10, k=k, verifier="strict"),
                                lambda: chat(s.url, QUESTIONS[0], max_tokens=10)])
                (status, answer), (other, _) = out
                t.case("k", status in (200, 400), f"k {k} at --batch-size {batch} -> {status} "
                                                  f"{str(answer)[:80] if status != 200 else ''}")
                t.case("k", other == 200, f"a request beside k {k} at --batch-size {batch} -> {other}")
                if "timeout" in (status, other):
                    s.stop()
                    s = make(["--parallel", "4", "--ctx", "1024", "--batch-size", batch])
        finally:
            s.stop()


def draft_company(t: Tally, make) -> None:
    s = make(["--parallel", "4", "--ctx", "1024", "--draft", DRAFT, "--threads", "auto"])
    variants = {"fly k 6": dict(drafter="model", k=6, verifier="fly", fly_entropy=0, fly_window=1),
                "seeded 0.5": dict(drafter="model", k=6, verifier="strict", temperature=0.5, seed=11)}
    try:
        for name, fields in variants.items():
            for q in QUESTIONS[:3]:
                ref = text_of(chat(s.url, q, max_tokens=48, **fields)[1])
                for rep in range(2):
                    started, stop = threading.Event(), threading.Event()
                    holder = threading.Thread(target=hold_stream, args=(s.url, LONG, 400, started, None, stop))
                    holder.start()
                    started.wait(60)
                    got = text_of(chat(s.url, q, max_tokens=48, **fields)[1])
                    stop.set()
                    holder.join(120)
                    t.case("draft", got == ref, f"{name}, {q!r} beside a long request: "
                                                f"{'same' if got == ref else f'{got!r} against {ref!r}'}")
    finally:
        s.stop()


def embeddings(t: Tally, make) -> None:
    s = make(["--parallel", "4", "--ctx", "1024"])
    sentence = "The quick brown fox jumps over the lazy dog near the river bank in the morning light."
    try:
        for rep in range(3):
            try:
                httpx.post(s.url + "/v1/embeddings", json={"input": [f"{sentence} {i}" for i in range(2048)]},
                           timeout=1.5)
            except httpx.TimeoutException:
                pass
            t0 = time.perf_counter()
            status, _ = chat(s.url, "Hi", max_tokens=8, timeout=20)
            t.case("embed", status == 200, f"a chat after an abandoned 2048-input embedding -> {status} in "
                                           f"{time.perf_counter() - t0:.1f} s")
            if status != 200:                    # an abandoned job that runs on for minutes: a fresh server
                s.stop()
                s = make(["--parallel", "4", "--ctx", "1024"])
        for rep in range(2):
            gaps = [[] for _ in range(3)]
            started = [threading.Event() for _ in range(3)]
            stop = threading.Event()
            holders = [threading.Thread(target=hold_stream, args=(s.url, QUESTIONS[i], 300, started[i], gaps[i], stop))
                       for i in range(3)]
            for h in holders:
                h.start()
            for e in started:
                e.wait(60)
            for g in gaps:
                g.clear()
            r = httpx.post(s.url + "/v1/embeddings", json={"input": [f"{sentence} {i}" for i in range(600)]},
                           timeout=600)
            stop.set()
            for h in holders:
                h.join(120)
            for i, g in enumerate(gaps):
                worst = max(g, default=0.0)
                t.case("embed", r.status_code == 200 and worst < 2.0,
                       f"stream {i} beside 600 inputs: longest wait {worst:.2f} s (embedding {r.status_code})")
        for rep in range(3):
            started = [threading.Event() for _ in range(4)]
            stop = threading.Event()
            holders = [threading.Thread(target=hold_stream, args=(s.url, QUESTIONS[i], 300, started[i], None, stop))
                       for i in range(4)]
            for h in holders:
                h.start()
            for e in started:
                e.wait(60)
            t0 = time.perf_counter()
            r = httpx.post(s.url + "/v1/embeddings", json={"input": sentence}, timeout=60)
            took = time.perf_counter() - t0
            stop.set()
            for h in holders:
                h.join(120)
            t.case("embed", r.status_code == 200 and took < 1.5, f"one string beside 4 streams: {took:.2f} s")
    finally:
        s.stop()


def admission(t: Tally, make) -> None:
    s = make(["--parallel", "2", "--max-queue", "0", "--ctx", "1024"])
    try:
        for burst in range(20):
            out = together([lambda: chat(s.url, QUESTIONS[0], max_tokens=8),
                            lambda: chat(s.url, QUESTIONS[1], max_tokens=8)])
            for status, answer in out:
                t.case("admission", status == 200, f"burst {burst}: {status} {str(answer)[:60] if status != 200 else ''}")
    finally:
        s.stop()


def stops(t: Tally, make) -> None:
    s = make(["--parallel", "4", "--ctx", "1024"])
    cases = [("List five fruits, one per line.", "an"), ("List five fruits, one per line.", "ana"),
             ("Name three colors.", "e"), ("Count from one to ten in words.", "ee"),
             ("Write a sentence about the sea.", "ea"), ("What is the capital of France?", "ar"),
             ("Spell the word banana.", "nan"), ("Name two planets.", "ar")]
    try:
        for question, stop in cases:
            problems = []
            status, answer = chat(s.url, question, max_tokens=48, stop=[stop], logprobs=True, verifier="strict")
            if status != 200:
                t.case("stop", False, f"{question!r} stop {stop!r}: {status}")
                continue
            text = text_of(answer)
            n = answer["usage"]["completion_tokens"]
            lp = answer["choices"][0]["logprobs"]["content"]
            if len(lp) != n:
                problems.append(f"{len(lp)} logprobs, {n} completion tokens")
            joined = "".join(e["token"] for e in lp)
            if not joined.startswith(text):
                problems.append(f"the tokens {joined!r} do not begin with the text {text!r}")
            body = {"messages": [{"role": "user", "content": question}], "max_tokens": 48, "temperature": 0,
                    "stop": [stop], "stream": True, "verifier": "strict"}
            chars = 0
            streamed = ""
            with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        data = json.loads(line[6:])
                        chars += sum((data.get("flylocal") or {}).get("chars", []))
                        if data["choices"]:
                            streamed += data["choices"][0]["delta"].get("content") or ""
            if streamed != text or chars != len(text):
                problems.append(f"streamed {streamed!r} with chars summing to {chars} for the text {text!r}")
            g = httpx.post(s.url + "/api/generate", json={"model": TARGET, "prompt": question, "stream": False,
                                                          "options": {"temperature": 0, "num_predict": 48,
                                                                      "stop": [stop]}}, timeout=60).json()
            made = len(g["context"]) - answer["usage"]["prompt_tokens"]     # the same prompt, templated alike
            if made != g["eval_count"] or made != n:
                problems.append(f"Ollama's context has {made} answer tokens, eval_count {g['eval_count']}")
            t.case("stop", not problems, f"{question!r} stop {stop!r} -> {text!r}: {'; '.join(problems) or 'agree'}")
    finally:
        s.stop()


def canary(t: Tally, make) -> None:
    s = make(["--parallel", "4", "--ctx", "1024"])
    rng = random.Random(7)
    requests = {"seeded": dict(temperature=0.5, seed=11, max_tokens=48),
                "strict": dict(verifier="strict", max_tokens=48)}
    question = "Write a haiku about the sea."
    try:
        refs = {name: text_of(chat(s.url, question, **fields)[1]) for name, fields in requests.items()}
        for i in range(CANARY[0]):
            for name, fields in requests.items():
                mine = lambda: chat(s.url, question, **fields)      # noqa: E731
                calls = [mine]
                for _ in range(rng.randint(0, 3)):
                    q, n, temp = rng.choice(QUESTIONS), rng.randint(4, 60), rng.choice([0, 0.7])
                    calls.append(lambda q=q, n=n, temp=temp: chat(s.url, q, max_tokens=n, temperature=temp))
                if rng.random() < 0.4:
                    n = rng.randint(1, 200)
                    calls.append(lambda n=n: httpx.post(s.url + "/v1/embeddings", json={
                        "input": [f"text {j}" for j in range(n)]}, timeout=120))
                rng.shuffle(calls)
                out = together(calls)
                got = text_of(out[calls.index(mine)][1])
                t.case("canary", got == refs[name], f"{name} #{i} in company of {len(calls) - 1}: "
                                                    f"{'same' if got == refs[name] else repr(got)}")
    finally:
        s.stop()


def gone(t: Tally, make) -> None:
    s = make(["--parallel", "4", "--ctx", "1024"])
    try:
        for i in range(5):
            before = s.text().count("\n")
            try:
                httpx.post(s.url + "/v1/chat/completions", timeout=0.3, json={
                    "messages": [{"role": "user", "content": LONG}], "max_tokens": 300})
            except httpx.TimeoutException:
                pass
            time.sleep(1.5)
            lines = [ln for ln in s.text().splitlines()[before:] if "/v1/chat/completions" in ln]
            t.case("gone", bool(lines) and " 499 " in lines[-1], f"a client that left: {lines[-1] if lines else 'no line'}")
    finally:
        s.stop()


CANARY = [30]          # rounds of the canary (--canary)
GROUPS = {"grammar": grammar, "k": draft_length, "draft": draft_company, "embed": embeddings,
          "admission": admission, "stop": stops, "canary": canary, "gone": gone}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", help="run the servers from this checkout of flylocal")
    ap.add_argument("--exact", action="store_true", help="the exact build")
    ap.add_argument("--groups", default=",".join(GROUPS))
    ap.add_argument("--json", help="write the table here")
    ap.add_argument("--canary", type=int, default=30, help="times each canary request is sent in company")
    args = ap.parse_args()
    CANARY[0] = args.canary
    t = Tally()

    def make(server_args):
        return Server(server_args, args.tree, args.exact)

    for name in args.groups.split(","):
        print(f"{name}:", flush=True)
        GROUPS[name](t, make)
    table = t.table()
    print(f"\n{'group':<10} {'tried':>6} {'bad':>5}  first bad")
    for g, row in table.items():
        print(f"{g:<10} {row['tried']:>6} {row['bad']:>5}  {row['first_bad'] or ''}")
    print(f"{'all':<10} {sum(r['tried'] for r in table.values()):>6} {sum(r['bad'] for r in table.values()):>5}")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
