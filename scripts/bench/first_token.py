"""Time to a fresh server's first token with an empty cost cache, and its second request's time.

Starts `flylocal serve` from a source tree (this one by default) with FLYLOCAL_COSTS set to a
new empty folder, streams one /v1/completions request of 4 tokens, times its first token, then
times a second request of 1 token; stops the server; `--repeat` servers in all. Loopback only.

    .venv/bin/python scripts/bench/first_token.py --target gemma-3-270m-f32 --repeat 3
    .venv/bin/python scripts/bench/first_token.py --tree /tmp/before     # a worktree of another commit
    .venv/bin/python scripts/bench/first_token.py --busy 1 --drafter none # beside a busy loop, plain
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_server(tree: Path, target: str, threads: int, extra: list[str]) -> tuple[float, float]:
    """(seconds to the first token of the first request, seconds of the second request)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as costs:
        env = dict(os.environ, FLYLOCAL_COSTS=costs, PYTHONPATH=str(tree))
        proc = subprocess.Popen([sys.executable, "-m", "flylocal", "serve", "--port", str(port), "--target", target,
                                 "--threads", str(threads), "--quiet", *extra], env=env, cwd=tree,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            started = time.perf_counter()
            first = None
            with httpx.stream("POST", url + "/v1/completions", timeout=300,
                              json={"prompt": "The capital of France is", "max_tokens": 4, "stream": True}) as r:
                for line in r.iter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.perf_counter() - started
            started = time.perf_counter()
            httpx.post(url + "/v1/completions", json={"prompt": "The capital of Spain is", "max_tokens": 1},
                       timeout=300)
            return first, time.perf_counter() - started
        finally:
            proc.terminate()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the source tree whose flylocal serves (default: this)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafter", default=None, help="the server's --drafter (default: its own default)")
    ap.add_argument("--busy", type=int, default=0, help="busy loops (unpinned) running beside the server")
    args = ap.parse_args()
    extra = ["--drafter", args.drafter] if args.drafter else []
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    runs = []
    try:
        for _ in range(args.repeat):
            first, second = one_server(args.tree, args.target, args.threads, extra)
            runs.append((first, second))
            print(f"{args.target}: first token {first:.3f} s, second request {second:.3f} s", flush=True)
    finally:
        for p in spin:
            p.kill()
            p.wait()
    firsts = [f for f, _ in runs]
    print(f"median first token {statistics.median(firsts):.3f} s (range {min(firsts):.3f}-{max(firsts):.3f}), "
          f"median second request {statistics.median(s for _, s in runs):.3f} s")


if __name__ == "__main__":
    main()
