#!/usr/bin/env python3
"""A bounded load on `flylocal serve` and on llama-cpp-python's own server, over loopback.

For each server configuration it starts the server on a free loopback port with the same
model, sends C concurrent streaming clients M chat requests each (prompts from
data/prompts.jsonl, temperature 0), stops by itself, and reports throughput (completion tokens
per second of wall time), p50/p95 latency, p50/p95 time to first token and errors. Then one
client alone compares a single stream's decode speed with `flylocal generate` on the same
prompts and settings (the overhead of the server).

    .venv/bin/python scripts/bench/serve.py [--clients 4] [--requests 3] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import threading
import time

import httpx

from harness import ROOT, cores, servers, stream_chat

PROMPTS = [json.loads(line)["prompt"] for line in (ROOT / "data" / "prompts.jsonl").read_text().splitlines()
           if json.loads(line)["category"] in ("qa", "summarization", "reply", "chat", "writing")]


MODEL = "smollm2-135m-instruct"


def one_request(url: str, prompt: str, max_tokens: int, extra: dict) -> dict:
    try:
        r = stream_chat(url, prompt, max_tokens, model=MODEL, extra=extra)
    except httpx.HTTPStatusError as e:
        return {"error": f"{e.response.status_code}"}
    first, last, end = r["first"], r["last"], r["end"]
    return {"latency": end - r["start"], "ttft": (first or end) - r["start"], "tokens": r["tokens"],
            "stream_tps": (r["tokens"] - 1) / (last - first) if first and last and last > first else None,
            "engine_tps": (r["usage"] or {}).get("flylocal", {}).get("tokens_per_s")}


def load(url: str, clients: int, requests: int, max_tokens: int, extra: dict) -> dict:
    results, lock = [], threading.Lock()

    def client(c: int) -> None:
        for i in range(requests):
            prompt = PROMPTS[(c * requests + i) % len(PROMPTS)]
            try:
                r = one_request(url, prompt, max_tokens, extra)
            except httpx.HTTPError as e:
                r = {"error": type(e).__name__}
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    for r in results:
        if "error" in r:
            print(f"  error: {r['error']}", file=sys.stderr)

    def pct(values, q):
        values = sorted(values)
        return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")

    return {"requests": len(results), "errors": len(results) - len(ok),
            "throughput": sum(r["tokens"] for r in ok) / wall,
            "p50": pct([r["latency"] for r in ok], 0.5), "p95": pct([r["latency"] for r in ok], 0.95),
            "ttft50": pct([r["ttft"] for r in ok], 0.5), "ttft95": pct([r["ttft"] for r in ok], 0.95)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=3, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--alone-only", action="store_true", help="only the single-stream comparison")
    args = ap.parse_args()
    from flylocal.models import resolve

    global MODEL
    MODEL = args.target
    path = str(resolve(args.target))
    threads = args.threads or len(cores())
    flylocal = [sys.executable, "-m", "flylocal", "serve", "--target", args.target, "--ctx", str(args.ctx),
                "--threads", str(threads), "--max-queue", str(args.clients * 2)]
    configs = [
        ("flylocal serve, pld + strict", flylocal + ["--drafter", "pld", "--verifier", "strict"], "/health"),
        ("flylocal serve, pld + fly", flylocal + ["--drafter", "pld", "--verifier", "fly"], "/health"),
        ("flylocal serve, autoregressive", flylocal + ["--drafter", "none", "--verifier", "strict"], "/health"),
        # interrupt_requests off: by default a new request cuts the one in flight short
        ("llama-cpp-python server", [sys.executable, "-m", "llama_cpp.server", "--model", path, "--n_ctx",
                                     str(args.ctx), "--n_threads", str(threads), "--host", "127.0.0.1",
                                     "--interrupt_requests", "False"], "/v1/models"),
    ]
    if args.alone_only:
        configs = []
    print(f"{args.target}, {args.clients} clients x {args.requests} requests, {args.max_tokens} tokens, "
          f"temperature 0, streaming, loopback")
    print("| server | requests | errors | throughput tok/s | p50 latency s | p95 latency s | p50 TTFT s | p95 TTFT s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, cmd, health in configs:
        with servers({name: cmd + ["--port", "{port}"]}, health) as urls:
            r = load(urls[name], args.clients, args.requests, args.max_tokens, {})
        print(f"| {name} | {r['requests']} | {r['errors']} | {r['throughput']:.1f} | {r['p50']:.2f} | "
              f"{r['p95']:.2f} | {r['ttft50']:.2f} | {r['ttft95']:.2f} |", flush=True)

    # One stream alone against `flylocal generate`, same prompts and settings, interleaved.
    single = PROMPTS[:4]

    def alone(url):
        served, generated = [], []
        for _ in range(2):
            for p in single:
                served.append(one_request(url, p, args.max_tokens, {"verifier": "strict", "drafter": "pld"}))
                # streaming its text, as the server does (--json would skip the detokenizing)
                done = subprocess.run([sys.executable, "-m", "flylocal", "generate", p, "--max-tokens",
                                       str(args.max_tokens), "--drafter", "pld", "--verifier", "strict",
                                       "--ctx", str(args.ctx), "--threads", str(threads)],
                                      capture_output=True, text=True, timeout=600, check=True)
                generated.append(float(re.search(r"([0-9.]+) tok/s", done.stderr).group(1)))
        return served, generated

    with servers({"alone": flylocal + ["--drafter", "pld", "--verifier", "strict", "--port", "{port}"]}) as urls:
        served, generated = alone(urls["alone"])
    engine = statistics.median(r["engine_tps"] for r in served)
    stream = statistics.median(r["stream_tps"] for r in served if r["stream_tps"])
    plain = statistics.median(generated)
    print(f"\none stream alone (pld + strict, {len(served)} requests, interleaved with `flylocal generate`): decode "
          f"tokens/s {engine:.1f} in the server's engine, {stream:.1f} as the client sees the stream, "
          f"{plain:.1f} in `flylocal generate`: {engine / plain:.3f}x and {stream / plain:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
