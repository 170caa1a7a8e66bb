#!/usr/bin/env python3
"""Spec-Bench through servers: flylocal serve's modes against llama.cpp's own llama-server.

One server per mode, each on a free loopback port with the same model, so that no mode reuses
another's cached prompt. For each question (the first turn of the first N of each Spec-Bench
group) every mode answers in turn, a different one first each time: streaming, greedy,
`--max-tokens` tokens, with a pause between requests that lets the last server's threads go
idle. Per mode: end-to-end tokens/s (completion tokens over the wall time from the request to
the last chunk) and decode tokens/s (the tokens after the first over the time after the
first), medians over questions; all tokens over all wall time; ratios to llama-server's plain
mode (or flylocal's plain mode without llama-server); and the median over questions of each
question's own end-to-end ratio, with a 95% bootstrap interval (questions resampled). `--modes`
runs some of the modes only: two modes over many questions narrow the interval most for the
device time.

The fast kernels are not batch-invariant, so two servers' greedy answers part at near-ties and
then differ in length; a short answer's end-to-end speed is mostly its prefill. So by default
the model's end-of-generation tokens get `logit_bias` -100 and every answer is `--max-tokens`
long (`--natural` lets answers end where the model ends them).

llama-server is built from the llama.cpp source that llama-cpp-python vendors (docs/benchmarks.md
says how); give its path with --llama-server. Every server is stopped on the way out.

    .venv/bin/python scripts/bench/servers.py [--llama-server PATH] [--per-category 4] [--max-tokens 128]
        [--modes "flylocal plain,llama-server plain"]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time

import numpy as np

from harness import flylocal_serve, interval, questions, servers, stream_chat

FLYLOCAL_MODES = {"flylocal plain": ["--drafter", "none", "--verifier", "strict"],
                  "flylocal strict-pld": ["--drafter", "pld", "--verifier", "strict"],
                  "flylocal fly-pld": ["--drafter", "pld", "--verifier", "fly"]}
LLAMA_MODES = {"llama-server plain": [], "llama-server ngram-mod": ["--spec-type", "ngram-mod"]}


def end_tokens(model_path: str) -> list[int]:
    """The model's end-of-generation token ids."""
    from flylocal.llama.runtime import Runtime, RuntimeConfig

    rt = Runtime(model_path, RuntimeConfig(n_ctx=256))
    try:
        return [int(t) for t in np.flatnonzero(rt.eog_mask)]
    finally:
        rt.close()


def ask(url: str, question: str, max_tokens: int, banned: list[int] = ()) -> dict:
    r = stream_chat(url, question, max_tokens, banned)
    tokens, first, last = r["tokens"], r["first"], r["last"]
    wall = (last or time.perf_counter()) - r["start"]
    decode = (tokens - 1) / (last - first) if first is not None and last > first and tokens > 1 else float("nan")
    return {"tokens": tokens, "wall": wall, "e2e": tokens / wall if wall > 0 else float("nan"), "decode": decode}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server")
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--pause", type=float, default=0.5, help="seconds between requests")
    ap.add_argument("--natural", action="store_true",
                    help="let answers end where the model ends them; by default its end-of-generation tokens "
                         "get logit_bias -100, so every answer is --max-tokens long in every mode")
    ap.add_argument("--modes", default=None,
                    help="comma-separated modes to run, of: " + ", ".join([*FLYLOCAL_MODES, *LLAMA_MODES]))
    args = ap.parse_args()
    known = [*FLYLOCAL_MODES, *(LLAMA_MODES if args.llama_server else ())]
    args.modes = [m.strip() for m in args.modes.split(",")] if args.modes else known
    if unknown := [m for m in args.modes if m not in known]:
        ap.error(f"--modes: unknown mode {unknown[0]!r}; known: {', '.join(known)}")
    base = "llama-server plain" if args.llama_server else "flylocal plain"
    if base not in args.modes:
        ap.error(f"--modes: the ratios are to {base!r}; include it")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    from flylocal import models

    path = str(models.resolve(args.target))
    qs = questions(args.per_category)
    banned = [] if args.natural else end_tokens(path)
    results: dict[str, list[dict]] = {}
    commands = {name: flylocal_serve("--target", args.target, "--ctx", str(args.ctx), *extra)
                for name, extra in FLYLOCAL_MODES.items() if name in args.modes}
    if args.llama_server:
        commands |= {name: [args.llama_server, "-m", path, "--port", "{port}", "--host", "127.0.0.1", "-c",
                            str(args.ctx), "--no-webui", *extra] for name, extra in LLAMA_MODES.items() if name in args.modes}
    with servers(commands) as urls:
        for url in urls.values():                # one warm-up request each, uncounted
            ask(url, "Hello!", 8)
        order = list(urls.items())
        for i, q in enumerate(qs):               # the modes take turns going first
            for name, url in order[i % len(order):] + order[: i % len(order)]:
                results.setdefault(name, []).append(ask(url, q, args.max_tokens, banned))
                time.sleep(args.pause)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("e2e", "decode")} for name, rs in results.items()}
    for name, rs in results.items():             # all tokens over all the time: long answers weigh more
        med[name]["total"] = sum(r["tokens"] for r in rs) / sum(r["wall"] for r in rs)
    print(f"{len(qs)} Spec-Bench questions (first turns, {args.per_category} per group), {args.target}, "
          f"{args.max_tokens} tokens{' or fewer' if args.natural else ' each'}, greedy, streamed, one server per mode, {os.cpu_count()} cores; "
          f"medians over questions, and all tokens over all wall time")
    # A question's modes ran back to back: the median of its own ratios is moved less by a
    # machine that drifts between questions than the ratio of medians is.
    ratios = {name: [r["e2e"] / b["e2e"] for r, b in zip(rs, results[base])] for name, rs in results.items()}
    print(f"| mode | tokens | end-to-end tok/s | / {base} | per question / {base} (95% interval) | decode tok/s | "
          f"/ {base} | all tokens / all time | / {base} |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, m in med.items():
        lo, hi = interval(ratios[name])
        print(f"| {name} | {sum(r['tokens'] for r in results[name])} | {m['e2e']:.1f} | {m['e2e'] / med[base]['e2e']:.2f} | "
              f"{statistics.median(ratios[name]):.2f} ({lo:.2f}-{hi:.2f}) | {m['decode']:.1f} | "
              f"{m['decode'] / med[base]['decode']:.2f} | {m['total']:.1f} | "
              f"{m['total'] / med[base]['total']:.2f} |")
    plain = "flylocal plain"
    if base != plain and plain in results:       # the drafting modes against flylocal's own plain mode
        for name in [n for n in FLYLOCAL_MODES if n != plain and n in results]:
            own = [r["e2e"] / b["e2e"] for r, b in zip(results[name], results[plain])]
            lo, hi = interval(own)
            print(f"{name} / {plain}, per question: {statistics.median(own):.2f} ({lo:.2f}-{hi:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
