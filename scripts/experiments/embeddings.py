"""Embeddings through the server (docs/benchmarks.md, "Embeddings"): inputs per second of
/v1/embeddings on held-out Spec-Bench questions and on short sentences, one input a request
against batches of them, whether a generation's speed changes once embeddings have run
beside it, and how long a one-word embedding waits after a client left a long input (about
3,000 tokens) 3 s into it.

    .venv/bin/python scripts/experiments/embeddings.py [--target NAME] [--per-category 4] [--repeat 3]
        [--batches 1,8,32] [--threads 2]

Prints inputs/s and tokens/s (median of `repeat` passes over each set) for each batch size,
a chat completion's tokens/s before and after the embeddings (the same request, strict,
greedy; median and range of 5), and the one-word embedding's wait (median and range of
`repeat`).

Answered (docs/benchmarks.md, "Embeddings", 2026-12-06): in pieces, batches kept their
speed, and a one-word request after a client left a 3,000-token input waited 0.56-0.81 s
against 12.88 s before.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # scripts/bench's shared helpers (harness)
from harness import flylocal_serve, median, questions, servers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--threads", default="2")
    args = ap.parse_args()
    texts = questions(args.per_category)
    batches = [int(b) for b in args.batches.split(",")]
    command = flylocal_serve("--target", args.target, "--threads", args.threads, "--ctx", "4096")
    with servers({"flylocal": command}) as urls:
        url = urls["flylocal"]
        chat = {"messages": [{"role": "user", "content": texts[0]}], "max_tokens": 64, "temperature": 0,
                "verifier": "strict"}

        def speed() -> float:
            body = httpx.post(url + "/v1/chat/completions", json=chat, timeout=300).json()
            return body["usage"]["flylocal"]["tokens_per_s"]

        before = [speed() for _ in range(5)]
        short = [f"Note {i}: the meeting about item {i} moved to room {100 + i}." for i in range(64)]
        for name, texts in (("Spec-Bench questions", texts), ("short sentences", short)):
            n_tokens = sum(httpx.post(url + "/v1/embeddings", json={"input": t}, timeout=300).json()["usage"]
                           ["prompt_tokens"] for t in texts)
            print(f"{len(texts)} {name}, {n_tokens} tokens in all ({n_tokens / len(texts):.0f} each)")
            for batch in batches:
                rates = []
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    for i in range(0, len(texts), batch):
                        reply = httpx.post(url + "/v1/embeddings", json={"input": texts[i:i + batch]}, timeout=300)
                        reply.raise_for_status()
                    rates.append(len(texts) / (time.perf_counter() - t0))
                rate = statistics.median(rates)
                print(f"  batch {batch:3d}: {rate:7.1f} inputs/s, {rate * n_tokens / len(texts):6.0f} tokens/s "
                      f"(inputs/s range {min(rates):.1f}-{max(rates):.1f}, {args.repeat} passes)")
        after = [speed() for _ in range(5)]
        print(f"chat completion, strict, 64 tokens: {median(before):.1f} tok/s before the embeddings "
              f"({min(before):.1f}-{max(before):.1f}), {median(after):.1f} after ({min(after):.1f}-{max(after):.1f})")
        waits = [abandoned(url) for _ in range(args.repeat)]
        print(f"a one-word embedding after a client left a long input 3 s into it: {median(waits):.2f} s "
              f"({min(waits):.2f}-{max(waits):.2f})")


def abandoned(url: str) -> float:
    """Seconds a one-word embedding takes once a client has left a long input 3 s into it."""
    long = " ".join(["the cat sat on the mat and looked at the dog"] * 273)     # about 3,000 tokens
    try:
        httpx.post(url + "/v1/embeddings", json={"input": long}, timeout=3).raise_for_status()
    except httpx.ReadTimeout:
        pass
    t0 = time.perf_counter()
    httpx.post(url + "/v1/embeddings", json={"input": "hello"}, timeout=300).raise_for_status()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
