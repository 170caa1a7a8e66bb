#!/usr/bin/env python3
"""This checkout's `flylocal serve` against another checkout's (`--tree PATH`, say a worktree of
an earlier commit), the same server options, one client: each question streamed to A and to B
in turn (a different one first each time), greedy, end-of-generation banned so every answer
has --max-tokens tokens. Reports each side's median tokens/s (completion tokens over the time
from the first text to the last) and time to first token, and the per-question ratio A/B as a
median with a 95% bootstrap interval. With --clients N, N different questions go to one side
at once (start the servers with --parallel N), and a group's rate is all its completion tokens
over the time from its first request to its last text.

    .venv/bin/python scripts/bench/ab_serve.py --tree /tmp/before [--target NAME] [--questions 12]
        [--max-tokens 96] [--repeat 2] [--clients 1] [-- SERVER OPTIONS]
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor

from harness import end_tokens, interval, median, questions, servers, stream_chat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", required=True, help="the other checkout (B)")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--questions", type=int, default=12, help="Spec-Bench questions (in turn from each group)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--clients", type=int, default=1, help="questions sent to one side at once")
    ap.add_argument("options", nargs="*", help="server options for both (after --)")
    args = ap.parse_args()
    qs = questions(max(1, args.questions // 6 + 1))[: args.questions]
    command = [sys.executable, "-m", "flylocal", "serve", "--port", "{port}", "--target", args.target, *args.options]
    # B runs from the other tree: its folder first on the path (`-m` puts the working folder there).
    other = ["sh", "-c", f"cd {shlex.quote(args.tree)} && exec " + " ".join(shlex.quote(c) for c in command)]
    from flylocal import models

    banned = end_tokens(str(models.resolve(args.target)))
    with servers({"A": command}) as a, servers({"B": other}, env=dict(os.environ, PYTHONPATH=args.tree)) as b:
        urls = {"A": a["A"], "B": b["B"]}
        rates: dict[str, list[float]] = {"A": [], "B": []}
        ttft: dict[str, list[float]] = {"A": [], "B": []}
        ratios = []
        for rep in range(args.repeat):
            for i, q in enumerate(qs):
                order = ("A", "B") if (i + rep) % 2 == 0 else ("B", "A")
                got = {}
                for side in order:
                    if args.clients > 1:
                        group = [qs[(i + j) % len(qs)] for j in range(args.clients)]
                        with ThreadPoolExecutor(args.clients) as pool:
                            done = list(pool.map(lambda q: stream_chat(urls[side], q, args.max_tokens, banned=banned),
                                                 group))
                        span = max(r["last"] for r in done) - min(r["start"] for r in done)
                        got[side] = sum(r["tokens"] for r in done) / span
                        ttft[side] += [r["first"] - r["start"] for r in done]
                        rates[side].append(got[side])
                        continue
                    r = stream_chat(urls[side], q, args.max_tokens, banned=banned)
                    decode = r["last"] - r["first"] if r["first"] and r["last"] else float("nan")
                    got[side] = (r["tokens"] - 1) / decode if decode > 0 else float("nan")
                    ttft[side].append(r["first"] - r["start"])
                    rates[side].append(got[side])
                ratios.append(got["A"] / got["B"])
        lo, hi = interval(ratios)
        for side in ("A", "B"):
            print(f"{side}: {median(rates[side]):.1f} tok/s, time to first token {median(ttft[side]) * 1000:.0f} ms")
        print(f"A/B tokens/s per question: {median(ratios):.3f} ({lo:.3f}-{hi:.3f}), {len(ratios)} pairs")


if __name__ == "__main__":
    main()
