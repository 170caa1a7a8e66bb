"""A soak of the prompt cache under a small bound (docs/benchmarks.md, "Conversations taking turns: the prompt cache"): --conversations
conversations, each with a system prompt of its own, come back in a shuffled order for --turns
turns each, on one server with --cache-ram MIB, while its resident memory (VmRSS) is read after
every turn; the same turns on a server with --cache-ram 0 give the reference answers.

Reports the server's RSS after its first answer (models and slots), the most it reached, what
/api/ps says it holds, the cache's entries, hits and evictions, and how many answers differ
from the reference (in exact mode, strict: none may).

    FLYLOCAL_EXACT=1 .venv/bin/python scripts/experiments/soak_cache.py [--conversations 100] [--cache-ram 64]

Answered (docs/benchmarks.md, "Conversations taking turns: the prompt cache", bounds): 100
conversations of 2 turns with --cache-ram 64 grew the server by at most 90 MiB over 200 turns,
every answer equal to the server's without a cache, once entries lived in anonymous memory maps.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # scripts/bench's shared helpers (harness)
from harness import servers, spec_bench_questions


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--conversations", type=int, default=100)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--cache-ram", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    texts = [t for _, t in spec_bench_questions(80)]
    rng = random.Random(0)
    systems = ["You answer briefly. Background:\n" + "\n".join(rng.sample(texts, 2))[:1500]
               for _ in range(args.conversations)]
    questions = [t for t in texts if len(t) < 200]
    order = [c for c in range(args.conversations) for _ in range(args.turns)]
    rng.shuffle(order)
    fly = [sys.executable, "-m", "flylocal", "serve", "--port", "{port}", "--quiet", "--target", args.target,
           "--ctx", "4096", "--parallel", "1", "--verifier", "strict"]
    answers = {}
    for name, extra in (("cache", ["--cache-ram", str(args.cache_ram)]), ("reference", ["--cache-ram", "0"])):
        with servers({name: fly + extra}) as urls:
            url = urls[name]
            pid = None
            history = {c: [{"role": "system", "content": systems[c]}] for c in range(args.conversations)}
            count = {c: 0 for c in range(args.conversations)}
            base = peak = None
            out = []
            for i, c in enumerate(order):
                history[c].append({"role": "user", "content": questions[(c + count[c]) % len(questions)]})
                count[c] += 1
                r = httpx.post(url + "/v1/chat/completions", timeout=600, json={
                    "messages": history[c], "max_tokens": args.max_tokens, "temperature": 0}).json()
                text = r["choices"][0]["message"]["content"]
                history[c].append({"role": "assistant", "content": text})
                out.append(text)
                if pid is None:
                    pid = server_pid(url)
                now = rss(pid)
                base = base or now
                peak = max(peak or 0, now)
            ps = httpx.get(url + "/api/ps").json()["models"][0]
            answers[name] = out
            cache = ps["flylocal"]["prompt_cache"]
            print(f"{name}: RSS after the first answer {base / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB "
                  f"(+{(peak - base) / 2**20:.0f}); /api/ps size {ps['size'] / 2**20:.0f} MiB"
                  + (f"; cache {cache['entries']} entries, {cache['bytes'] / 2**20:.1f} of "
                     f"{cache['limit_bytes'] / 2**20:.0f} MiB, {cache['hits']} hits, {cache['evicted']} evicted, "
                     f"{cache['prefill_seconds_saved']:.1f} s of prefill saved" if cache else ""), flush=True)
    differ = sum(a != b for a, b in zip(answers["cache"], answers["reference"]))
    print(f"answers that differ from the server without a cache: {differ} of {len(order)}")
    return 0


def server_pid(url: str) -> int:
    """The pid listening on `url`'s port (from /proc/net/tcp and the processes' sockets)."""
    import os

    port = int(url.rsplit(":", 1)[1])
    inodes = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            if int(parts[1].split(":")[1], 16) == port and parts[3] == "0A":
                inodes.add(parts[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(pid)
        except OSError:
            continue
    raise SystemExit(f"no process listens on port {port}")


if __name__ == "__main__":
    sys.exit(main())
