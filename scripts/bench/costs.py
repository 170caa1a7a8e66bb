#!/usr/bin/env python3
"""Speculation after a busy spell: decode speed with a poisoned or load-measured cost cache,
against a healthy one.

One prompt (a copy edit, where prompt lookup pays), strict verification with prompt lookup,
each generation a `flylocal generate --json` process of its own. Every cache here is a
temporary folder (`FLYLOCAL_COSTS`); the user's is never touched. Per repetition, in turn:

- healthy: a cache calibrated on the idle machine at the start;
- poisoned: the same, its file overwritten with the curve a busy hour left (calibrated values
  right, refined ones 100x too dear at 2-9 rows; the issue's table), then one run;
- after load: the healthy cache, one generation with busy loops on every core (its figures
  are printed too), then one run on the idle machine;
- load first: an empty cache whose first generation (and calibration) ran beside busy loops
  on every core, then one run on the idle machine.

Printed: the median decode tokens/s of each, its ratio to healthy, the drafted tokens, the mean
accepted length and the state of the curve the measured run used.

    .venv/bin/python scripts/bench/costs.py [--target NAME] [--max-tokens 160] [--repeat 3] [--exact]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from loadgen import LOAD_LIMIT_S, busy

from harness import ROOT

PROMPT_ID = "copy-edit-lighthouse"
POISON = {"base": [0.0084, 0.0143, 0.0204, None, 0.0285, None, None, None, 0.046] + [None] * 7 + [0.0772],
          "seconds": [0.0114, 1.620, 1.724, None, 1.622, None, None, None, 1.656] + [None] * 7 + [0.0772]}


def prompt_text() -> str:
    with open(ROOT / "data" / "prompts.jsonl", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row["id"] == PROMPT_ID:
                return row["prompt"]
    raise KeyError(PROMPT_ID)


def generate(args, costs: Path) -> dict:
    argv = [sys.executable, "-m", "flylocal", "generate", prompt_text(), "--target", args.target,
            "--max-tokens", str(args.max_tokens), "--verifier", "strict", "--drafter", "pld", "--json"]
    env = dict(os.environ, FLYLOCAL_COSTS=str(costs), FLYLOCAL_EXACT="1" if args.exact else "0")
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, timeout=LOAD_LIMIT_S)
    return json.loads(out.stdout)["stats"]


def healthy_cache(args, folder: Path) -> Path:
    """A cache whose curve settled on the idle machine (calibrated again until it does)."""
    for _ in range(5):
        shutil.rmtree(folder, ignore_errors=True)
        if generate(args, folder)["cost_curve"]["state"] == "settled":
            return folder
    raise SystemExit("the cost curve did not settle in 5 tries: is the machine idle?")


def copy(src: Path, dst: Path) -> Path:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--exact", action="store_true", help="the batch-invariant build")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))      # the load is stopped on the way out
    cores = sorted(os.sched_getaffinity(0))
    work = Path(tempfile.mkdtemp(prefix="flylocal-bench-costs-"))
    try:
        healthy = healthy_cache(args, work / "healthy")
        runs: dict[str, list[dict]] = {"healthy": [], "poisoned": [], "after load": [], "load first": []}
        loaded: list[dict] = []
        for _ in range(args.repeat):
            runs["healthy"].append(generate(args, healthy))
            poisoned = copy(healthy, work / "poisoned")
            for path in poisoned.glob("*.json"):
                key = json.loads(path.read_text())["key"]
                path.write_text(json.dumps({"format": 1, "key": key, **POISON}))
            runs["poisoned"].append(generate(args, poisoned))
            after = copy(healthy, work / "after")
            first = work / "first"
            shutil.rmtree(first, ignore_errors=True)
            with busy(cores):
                loaded.append(generate(args, after))
                loaded.append(generate(args, first))
            runs["after load"].append(generate(args, after))
            runs["load first"].append(generate(args, first))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    base = statistics.median(s["tokens_per_s"] for s in runs["healthy"])
    build = "exact" if args.exact else "fast"
    print(f"target {args.target}, {build} build, prompt {PROMPT_ID}, strict-pld, {args.max_tokens} tokens, "
          f"{len(cores)} cores, repeat {args.repeat}; decode tokens/s, median")
    print("| cache | decode tok/s | / healthy | drafted | mean accepted length | curve state |")
    print("|---|---|---|---|---|---|")
    for name, stats in runs.items():
        speed = statistics.median(s["tokens_per_s"] for s in stats)
        states = sorted({s["cost_curve"]["state"] for s in stats})
        print(f"| {name} | {speed:.1f} | {speed / base:.2f} | {statistics.median(s['drafted'] for s in stats):.0f} | "
              f"{statistics.median(s['mean_accepted_length'] for s in stats):.2f} | {', '.join(states)} |")
    speed = statistics.median(s["tokens_per_s"] for s in loaded)
    states = sorted({s["cost_curve"]["state"] for s in loaded})
    print(f"| (the runs beside busy loops on every core) | {speed:.1f} | {speed / base:.2f} | "
          f"{statistics.median(s['drafted'] for s in loaded):.0f} | "
          f"{statistics.median(s['mean_accepted_length'] for s in loaded):.2f} | {', '.join(states)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
