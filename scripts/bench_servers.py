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

    .venv/bin/python scripts/bench_servers.py [--llama-server PATH] [--per-category 4] [--max-tokens 128]
        [--modes "flylocal plain,llama-server plain"]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FLYLOCAL_MODES = {"flylocal plain": ["--drafter", "none", "--verifier", "strict"],
                  "flylocal strict-pld": ["--drafter", "pld", "--verifier", "strict"],
                  "flylocal fly-pld": ["--drafter", "pld", "--verifier", "fly"]}
LLAMA_MODES = {"llama-server plain": [], "llama-server ngram-mod": ["--spec-type", "ngram-mod"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def questions(per_category: int) -> list[str]:
    sys.path.insert(0, str(ROOT))
    from flylocal.front.bench import load_prompts, per_group

    return [p.text for p in per_group(load_prompts(str(ROOT / "data" / "spec_bench")), per_category)]


@contextlib.contextmanager
def servers(args, model_path: str):
    procs, urls = [], {}
    logs = []
    try:
        for name, extra in FLYLOCAL_MODES.items():
            if name not in args.modes:
                continue
            port = free_port()
            log = tempfile.TemporaryFile()
            procs.append(subprocess.Popen([sys.executable, "-m", "flylocal", "serve", "--port", str(port), "--quiet",
                                           "--target", args.target, "--ctx", str(args.ctx), *extra],
                                          stdout=log, stderr=log))
            urls[name] = f"http://127.0.0.1:{port}"
            logs.append(log)
        if args.llama_server:
            for name, extra in LLAMA_MODES.items():
                if name not in args.modes:
                    continue
                port = free_port()
                log = tempfile.TemporaryFile()
                procs.append(subprocess.Popen([args.llama_server, "-m", model_path, "--port", str(port),
                                               "--host", "127.0.0.1", "-c", str(args.ctx), "--no-webui", *extra],
                                              stdout=log, stderr=log))
                urls[name] = f"http://127.0.0.1:{port}"
                logs.append(log)
        deadline = time.monotonic() + 300
        for (name, url), proc, log in zip(urls.items(), procs, logs):
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise SystemExit(f"{name} exited: {log.read()[-2000:].decode(errors='replace')}")
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"{name} did not become ready")
                time.sleep(0.25)
        yield urls
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


def end_tokens(model_path: str) -> list[int]:
    """The model's end-of-generation token ids."""
    from flylocal.llama.runtime import Runtime, RuntimeConfig

    rt = Runtime(model_path, RuntimeConfig(n_ctx=256))
    try:
        return [int(t) for t in np.flatnonzero(rt.eog_mask)]
    finally:
        rt.close()


def ask(url: str, question: str, max_tokens: int, banned: list[int] = ()) -> dict:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if banned:
        body["logit_bias"] = {str(t): -100 for t in banned}
    t0 = time.perf_counter()
    first = last = None
    chunks, tokens = 0, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
            if data.get("choices") and data["choices"][0].get("delta", {}).get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
                chunks += 1
    tokens = tokens if tokens is not None else chunks
    wall = (last or time.perf_counter()) - t0
    decode = (tokens - 1) / (last - first) if first is not None and last > first and tokens > 1 else float("nan")
    return {"tokens": tokens, "wall": wall, "e2e": tokens / wall if wall > 0 else float("nan"), "decode": decode}


def interval(ratios: list[float], draws: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """A 95% bootstrap interval for the median of per-question ratios (questions resampled)."""
    r = np.asarray(ratios)
    picks = np.random.default_rng(seed).integers(0, len(r), size=(draws, len(r)))
    lo, hi = np.percentile(np.median(r[picks], axis=1), [2.5, 97.5])
    return float(lo), float(hi)


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
    sys.path.insert(0, str(ROOT))
    from flylocal import models

    path = str(models.resolve(args.target))
    qs = questions(args.per_category)
    banned = [] if args.natural else end_tokens(path)
    results: dict[str, list[dict]] = {}
    with servers(args, path) as urls:
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
