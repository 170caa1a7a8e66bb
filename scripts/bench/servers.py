#!/usr/bin/env python3
"""Spec-Bench through servers: flylocal serve's modes against llama.cpp's own llama-server.

One server per mode, each on a free loopback port with the same model, so that no mode reuses
another's cached prompt. For each question (the first turn of N of each Spec-Bench group, after
the first `--skip` of each: those the tuning has seen) every mode answers in turn, a different
one first each time: streaming, greedy, `--max-tokens` tokens, with a pause between requests
that lets the last server's threads go idle. Per mode: end-to-end tokens/s (completion tokens
over the wall time from the request to the last chunk) and decode tokens/s (the tokens after
the first over the time after the first), medians over questions; all tokens over all wall
time; ratios to llama-server's plain mode (or flylocal's plain mode without llama-server); the
median over questions of each question's own end-to-end ratio, with a 95% bootstrap interval
(questions resampled); and each mode's worst question, the lowest of those ratios. Every
drafting mode is also set against flylocal's own plain mode, question by question, and
flylocal's against llama-server's best speculative mode. `--modes` runs some of the modes only.

A base model (the bandwidth-bound stand-in) answers raw completions, `Question: ...\nAnswer:`
(`--raw`); an instruct model answers chat requests. The draft-model modes (flylocal's strict-mla and fly-mla,
llama-server's draft-simple) need `--draft`. `--threads` gives every server the same threads.

The fast kernels are not batch-invariant, so two servers' greedy answers part at near-ties and
then differ in length; a short answer's end-to-end speed is mostly its prefill. So by default
the model's end-of-generation tokens get `logit_bias` -100 and every answer is `--max-tokens`
long (`--natural` lets answers end where the model ends them).

llama-server is built from the llama.cpp source that llama-cpp-python vendors (docs/benchmarks.md
says how); give its path with --llama-server. Every server is stopped on the way out.

    .venv/bin/python scripts/bench/servers.py [--llama-server PATH] [--per-category 4] [--skip 0]
        [--max-tokens 128] [--target NAME] [--draft NAME] [--raw] [--threads N]
        [--modes "flylocal plain,llama-server plain"]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time

from harness import end_tokens, flylocal_serve, interval, servers, spec_bench_questions, stream_chat

FLYLOCAL_MODES = {"flylocal plain": ["--drafter", "none", "--verifier", "strict"],
                  "flylocal strict-pld": ["--drafter", "pld", "--verifier", "strict"],
                  "flylocal fly-pld": ["--drafter", "pld", "--verifier", "fly"],    # the default method
                  "flylocal strict-mla": ["--drafter", "mla", "--verifier", "strict", "--draft", "{draft}"],
                  "flylocal fly-mla": ["--drafter", "mla", "--verifier", "fly", "--draft", "{draft}"]}
LLAMA_MODES = {"llama-server plain": [], "llama-server ngram-mod": ["--spec-type", "ngram-mod"],
               "llama-server draft": ["-md", "{draft}", "--spec-type", "draft-simple"]}
NEEDS_DRAFT = ("flylocal strict-mla", "flylocal fly-mla", "llama-server draft")


def ask(url: str, question: str, max_tokens: int, banned: list[int] = (), raw: bool = False) -> dict:
    r = stream_chat(url, question, max_tokens, banned, raw=raw)
    tokens, first, last = r["tokens"], r["first"], r["last"]
    wall = (last or time.perf_counter()) - r["start"]
    decode = (tokens - 1) / (last - first) if first is not None and last > first and tokens > 1 else float("nan")
    return {"tokens": tokens, "wall": wall, "e2e": tokens / wall if wall > 0 else float("nan"), "decode": decode}


def worst(ratios: list[float], labels: list[str]) -> str:
    """The lowest ratio, with its question's label."""
    i = min(range(len(ratios)), key=ratios.__getitem__)
    return f"{ratios[i]:.2f} ({labels[i]})"


def against(name: str, other: str, results: dict, labels: list[str]) -> str:
    """`name`'s end-to-end speed over `other`'s, question by question: median, interval, worst."""
    own = [r["e2e"] / b["e2e"] for r, b in zip(results[name], results[other])]
    lo, hi = interval(own)
    return f"median {statistics.median(own):.2f} ({lo:.2f}-{hi:.2f}), worst {worst(own, labels)}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default=None, help="the draft model of fly-mla and llama-server's draft mode")
    ap.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server")
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--skip", type=int, default=0, help="questions of each group passed over first (held out)")
    ap.add_argument("--spec-bench", default=None, help="a folder with Spec-Bench's question.jsonl (the project's copy)")
    ap.add_argument("--raw", action="store_true", help="raw completions 'Question: ...\\nAnswer:' (a base model)")
    ap.add_argument("--threads", type=int, default=None, help="threads of every server (each its default)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--pause", type=float, default=0.5, help="seconds between requests")
    ap.add_argument("--natural", action="store_true",
                    help="let answers end where the model ends them; by default its end-of-generation tokens "
                         "get logit_bias -100, so every answer is --max-tokens long in every mode")
    ap.add_argument("--modes", default=None,
                    help="comma-separated modes to run, of: " + ", ".join([*FLYLOCAL_MODES, *LLAMA_MODES]))
    args = ap.parse_args()
    known = [m for m in [*FLYLOCAL_MODES, *(LLAMA_MODES if args.llama_server else ())]
             if args.draft or m not in NEEDS_DRAFT]
    args.modes = [m.strip() for m in args.modes.split(",")] if args.modes else known
    if unknown := [m for m in args.modes if m not in known]:
        ap.error(f"--modes: unknown mode {unknown[0]!r}; known: {', '.join(known)}"
                 + ("" if args.draft else f" ({' and '.join(NEEDS_DRAFT)} need --draft)"))
    base = "llama-server plain" if args.llama_server else "flylocal plain"
    if base not in args.modes:
        ap.error(f"--modes: the ratios are to {base!r}; include it")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    from flylocal import models
    from flylocal.front.bench.prompts import BASE_FORM

    path = str(models.resolve(args.target))
    draft = str(models.resolve(args.draft)) if args.draft else ""
    asked = spec_bench_questions(args.per_category, args.skip, args.spec_bench)
    labels = [f"{group} {i % args.per_category + 1}" for i, (group, _) in enumerate(asked)]
    qs = [BASE_FORM.format(text) if args.raw else text for _, text in asked]
    banned = [] if args.natural else end_tokens(path)
    threads = ["--threads", str(args.threads)] if args.threads else []
    results: dict[str, list[dict]] = {}
    commands = {name: flylocal_serve("--target", args.target, "--ctx", str(args.ctx), *threads,
                                     *[a.replace("{draft}", draft) for a in extra])
                for name, extra in FLYLOCAL_MODES.items() if name in args.modes}
    if args.llama_server:
        own = [f for flag in ("-t", "-tb", "-td", "-tbd") for f in (flag, str(args.threads))] if args.threads else []
        commands |= {name: [args.llama_server, "-m", path, "--port", "{port}", "--host", "127.0.0.1", "-c",
                            str(args.ctx), "--no-webui", *own, *[a.replace("{draft}", draft) for a in extra]]
                     for name, extra in LLAMA_MODES.items() if name in args.modes}
    with servers(commands) as urls:
        for url in urls.values():                # one warm-up request each, uncounted
            ask(url, BASE_FORM.format("Hello!") if args.raw else "Hello!", 8, raw=args.raw)
        order = list(urls.items())
        for i, q in enumerate(qs):               # the modes take turns going first
            for name, url in order[i % len(order):] + order[: i % len(order)]:
                results.setdefault(name, []).append(ask(url, q, args.max_tokens, banned, args.raw))
                time.sleep(args.pause)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("e2e", "decode")} for name, rs in results.items()}
    for name, rs in results.items():             # all tokens over all the time: long answers weigh more
        med[name]["total"] = sum(r["tokens"] for r in rs) / sum(r["wall"] for r in rs)
    print(f"{len(qs)} Spec-Bench questions (first turns, {args.per_category} per group after {args.skip}), "
          f"{args.target}{' as raw completions' if args.raw else ''}{f', draft {args.draft}' if args.draft else ''}, "
          f"{args.max_tokens} tokens{' or fewer' if args.natural else ' each'}, greedy, streamed, one server per "
          f"mode, {f'{args.threads} threads each, ' if args.threads else ''}{os.cpu_count()} cores; "
          f"medians over questions, and all tokens over all wall time")
    # A question's modes ran back to back: the median of its own ratios is moved less by a
    # machine that drifts between questions than the ratio of medians is.
    ratios = {name: [r["e2e"] / b["e2e"] for r, b in zip(rs, results[base])] for name, rs in results.items()}
    print(f"| mode | tokens | end-to-end tok/s | / {base} | per question / {base} (95% interval) | worst question | "
          f"decode tok/s | / {base} | all tokens / all time | / {base} |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, m in med.items():
        lo, hi = interval(ratios[name])
        print(f"| {name} | {sum(r['tokens'] for r in results[name])} | {m['e2e']:.1f} | "
              f"{m['e2e'] / med[base]['e2e']:.2f} | {statistics.median(ratios[name]):.2f} ({lo:.2f}-{hi:.2f}) | "
              f"{worst(ratios[name], labels)} | {m['decode']:.1f} | {m['decode'] / med[base]['decode']:.2f} | "
              f"{m['total']:.1f} | {m['total'] / med[base]['total']:.2f} |")
    plain = "flylocal plain"
    if plain in results:                         # every drafting mode against flylocal's own plain mode
        for name in [n for n in results if n not in (plain, "llama-server plain")]:
            print(f"{name} / {plain}, per question: {against(name, plain, results, labels)}")
    spec = [n for n in results if n.startswith("llama-server") and n != "llama-server plain"]
    if spec:                                     # flylocal's against llama-server's best speculative mode
        best = max(spec, key=lambda n: statistics.median(ratios[n]))
        for name in [n for n in results if n.startswith("flylocal") and n != plain]:
            print(f"{name} / {best} (llama-server's best speculative mode here), per question: "
                  f"{against(name, best, results, labels)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
