"""Time to a fresh server's first token with an empty cost cache, and its second request's time.

Starts `flylocal serve` (from another checkout with `--tree`) with FLYLOCAL_COSTS a new empty
folder, streams one /v1/completions request of 4 tokens, times its first token, then times a
second request of 1 token, and stops the server; `--repeat` servers in all. Loopback only.

    .venv/bin/python scripts/bench/first_token.py --target gemma-3-270m-f32 --repeat 3
    .venv/bin/python scripts/bench/first_token.py --tree /tmp/before     # a worktree of another commit
    .venv/bin/python scripts/bench/first_token.py --busy 1 --drafter none # beside a busy loop, plain
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time

import httpx
from harness import flylocal_serve, median, servers


def one_server(command: list[str], env: dict) -> tuple[float, float]:
    """(seconds to the first token of the first request, seconds of the second request)."""
    with tempfile.TemporaryDirectory() as costs, servers({"server": command}, env=env | {"FLYLOCAL_COSTS": costs}) as urls:
        url = urls["server"]
        started, first = time.perf_counter(), None
        with httpx.stream("POST", url + "/v1/completions", timeout=300,
                          json={"prompt": "The capital of France is", "max_tokens": 4, "stream": True}) as r:
            for line in r.iter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.perf_counter() - started
        started = time.perf_counter()
        httpx.post(url + "/v1/completions", json={"prompt": "The capital of Spain is", "max_tokens": 1}, timeout=300)
        return first, time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--tree", default=None, help="another checkout whose flylocal serves (default: this one)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafter", default=None, help="the server's --drafter (default: its own default)")
    ap.add_argument("--busy", type=int, default=0, help="busy loops (unpinned) running beside the server")
    args = ap.parse_args()
    command = flylocal_serve("--target", args.target, "--threads", str(args.threads),
                             *(["--drafter", args.drafter] if args.drafter else []))
    env = dict(os.environ)
    if args.tree:    # its folder first on the path (`-m` puts the working folder there), as ab_serve.py runs B
        command = ["sh", "-c", f"cd {shlex.quote(args.tree)} && exec " + " ".join(shlex.quote(c) for c in command)]
        env["PYTHONPATH"] = args.tree
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    runs = []
    try:
        for _ in range(args.repeat):
            runs.append(one_server(command, env))
            print(f"{args.target}: first token {runs[-1][0]:.3f} s, second request {runs[-1][1]:.3f} s", flush=True)
    finally:
        for p in spin:
            p.kill()
            p.wait()
    firsts = [f for f, _ in runs]
    print(f"median first token {median(firsts):.3f} s (range {min(firsts):.3f}-{max(firsts):.3f}), "
          f"median second request {median([s for _, s in runs]):.3f} s")


if __name__ == "__main__":
    main()
