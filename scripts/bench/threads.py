#!/usr/bin/env python3
"""--threads auto against fixed thread counts on a busy machine.

For each condition (no load, a busy loop on one core, busy loops on every core) this script
starts the load itself: one process per loaded core, pinned to it, spinning until a deadline
(and killed when the condition ends, or when this script is stopped). Under that load it
generates with the target on every core, on 1 thread and with auto, and prints the median
decode tokens/s of each and auto's ratios to all cores and to the best fixed count.

Each measurement is a child process that loads the target, warms up with one uncounted
generation (auto's controller learns what it learns there, as in the first turn of a chat) and
then generates every prompt: one process per mode, since llama.cpp contexts in one process
share one OpenMP runtime, and a mode's threads would disturb the next one's. The modes take
turns within each repetition.

With --whole, each measurement is instead one `flylocal generate` process, with no warm-up,
timed as a whole from its start to its exit (model load and prompt included): tokens over those
seconds. Its cost curves and --threads auto's kept count live in this run's own folder, shared
by the processes as a user's would be, so each auto process starts from what the last one
learnt; one uncounted run per fixed count calibrates the curves first. Its conditions: idle,
busy loops pinned to one core and to every core, one and n busy loops the scheduler may move
between cores (unpinned), and a real neighbour (another `flylocal generate` on every core,
over and over); the table adds auto's worst run against the best fixed count's median.

    .venv/bin/python scripts/bench/threads.py [--target NAME] [--drafter pld] [--max-tokens 64] [--repeat 3]
    .venv/bin/python scripts/bench/threads.py --whole [--max-tokens 96] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile

from loadgen import LOAD_LIMIT_S, busy, command, unpinned

from harness import ROOT

PROMPT_IDS = ("chat-focus", "copy-edit-keeper")
def child(args) -> int:
    """One mode under the current load: decode tokens/s of each prompt, as JSON on stdout."""
    from flylocal.decoding.engine import generate_all
    from flylocal.front.bench import load_prompts
    from flylocal.llama.runtime import Runtime, RuntimeConfig
    from flylocal.loader import build_engine, encode_prompt
    from flylocal.models import resolve
    from flylocal.settings import Settings

    threads = None if args.child == "auto" else int(args.child)
    prompts = [p.text for p in load_prompts(str(ROOT / "data" / "prompts.jsonl")) if p.id in PROMPT_IDS]
    settings = Settings(target=args.target, drafter=args.drafter, verifier="strict", max_tokens=args.max_tokens)
    speeds = []
    with Runtime(resolve(args.target), RuntimeConfig(n_ctx=2048, n_threads=threads)) as rt:
        for i, text in enumerate(prompts[:1] + prompts):       # the first run warms up, uncounted
            rt.reset()
            ids, _ = encode_prompt(rt, text, raw=False)
            _, stats, _ = generate_all(build_engine(settings, rt, None), ids)
            if i:
                speeds.append(stats.tokens_per_s)
        print(json.dumps({"tokens_per_s": speeds, "threads": rt.n_threads}))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default="pld", choices=["none", "pld"])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--whole", action="store_true", help="time whole `flylocal generate` processes")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if args.whole:
        return whole(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))      # the load is stopped on the way out
    # Cost curves of this run's own, calibrated in the idle condition: a run under load never
    # touches the user's cache.
    os.environ["FLYLOCAL_COSTS"] = tempfile.mkdtemp(prefix="flylocal-bench-threads-costs-")

    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
    n = len(cores)
    modes = {f"all {n}": str(n), "1 thread": "1", "auto": "auto"}
    conditions = {"idle": [], "one core busy": cores[:1], "all cores busy": cores}
    print(f"target {args.target}, drafter {args.drafter}, {args.max_tokens} tokens, {n} cores, "
          f"repeat {args.repeat}; decode tokens/s, median over prompts {', '.join(PROMPT_IDS)}")
    print(f"| condition | {' | '.join(modes)} | auto / all | auto / best fixed | auto's final threads |")
    print("|---" * (len(modes) + 4) + "|", flush=True)
    for condition, loaded in conditions.items():
        speed = {mode: [] for mode in modes}
        final = []
        with busy(loaded):
            for _ in range(args.repeat):
                for mode, value in modes.items():
                    out = subprocess.run([sys.executable, __file__, "--child", value, "--target", args.target,
                                          "--drafter", args.drafter, "--max-tokens", str(args.max_tokens)],
                                         capture_output=True, text=True, check=True, timeout=LOAD_LIMIT_S)
                    result = json.loads(out.stdout.strip().splitlines()[-1])
                    speed[mode] += result["tokens_per_s"]
                    if value == "auto":
                        final.append(result["threads"])
        med = {mode: statistics.median(v) for mode, v in speed.items()}
        best = max(med[m] for m in modes if m != "auto")
        print(f"| {condition} | " + " | ".join(f"{med[m]:.1f}" for m in modes)
              + f" | {med['auto'] / med[f'all {n}']:.2f} | {med['auto'] / best:.2f} | "
              + ", ".join(map(str, final)) + " |", flush=True)
    return 0


def generate(args, threads: str) -> tuple[float, float, int]:
    """One `flylocal generate` process: (tokens / its whole wall time, decode tokens/s, the
    threads it ended on (auto) or was given)."""
    import time

    from flylocal.front.bench import load_prompts

    text = next(p.text for p in load_prompts(str(ROOT / "data" / "prompts.jsonl")) if p.id == PROMPT_IDS[0])
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "flylocal", "generate", "--target", args.target, "--drafter",
                          args.drafter, "--verifier", "strict", "--max-tokens", str(args.max_tokens), "--threads",
                          threads, "--json", text],
                         capture_output=True, text=True, check=True, timeout=LOAD_LIMIT_S)
    wall = time.perf_counter() - t0
    result = json.loads(out.stdout)
    stats = result["stats"]
    return stats["emitted"] / wall, stats["tokens_per_s"], result["threads"]


def whole(args) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    os.environ["FLYLOCAL_COSTS"] = tempfile.mkdtemp(prefix="flylocal-bench-threads-costs-")
    os.environ["FLYLOCAL_EXACT"] = "0"
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
    n = len(cores)
    modes = {f"{n} threads": str(n), "1 thread": "1", "auto": "auto"}
    for value in modes.values():
        if value != "auto":
            generate(args, value)                    # calibrates the cost curve of that count, uncounted
    # A real neighbour: another flylocal generating on every core, over and over.
    neighbour = [sys.executable, "-m", "flylocal", "generate", "--target", args.target, "--threads", str(n),
                 "--max-tokens", "256", "Write a long story about a lighthouse keeper."]
    conditions = {"idle": busy([]), "one core busy, pinned": busy(cores[:1]), "all cores busy, pinned": busy(cores),
                  "one busy loop, unpinned": unpinned(1), f"{n} busy loops, unpinned": unpinned(n),
                  "another flylocal on every core": command(neighbour)}
    print(f"target {args.target}, drafter {args.drafter}, {args.max_tokens} tokens, {n} cores, repeat {args.repeat}: "
          "one `flylocal generate` process per run, tokens / its whole wall time (decode tokens/s in brackets), "
          "medians, and auto's worst run against the best fixed count's median")
    print(f"| condition | {' | '.join(modes)} | auto / best fixed | auto's worst / best fixed | auto's threads at the end |")
    print("|---" * (len(modes) + 4) + "|", flush=True)
    for condition, load in conditions.items():
        runs = {mode: [] for mode in modes}
        with load:
            for _ in range(args.repeat):
                for mode, value in modes.items():
                    runs[mode].append(generate(args, value))
        med = {mode: statistics.median(r[0] for r in v) for mode, v in runs.items()}
        dec = {mode: statistics.median(r[1] for r in v) for mode, v in runs.items()}
        best = max(med[m] for m in modes if m != "auto")
        worst = min(r[0] for r in runs["auto"])
        print(f"| {condition} | " + " | ".join(f"{med[m]:.1f} ({dec[m]:.1f})" for m in modes)
              + f" | {med['auto'] / best:.2f} | {worst / best:.2f} | " + ", ".join(str(r[2]) for r in runs["auto"])
              + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
