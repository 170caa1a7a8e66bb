#!/usr/bin/env python3
"""Speculation after a busy spell: decode speed with a poisoned or load-measured cost cache,
against a healthy one.

One prompt (a copy edit, where prompt lookup pays), strict verification with prompt lookup,
each generation a `flylocal generate --json` process of its own. Every cache here is a
temporary folder (`FLYLOCAL_COSTS`); the user's is never touched. Per repetition, in turn:

- healthy: a cache calibrated on the idle machine at the start;
- poisoned: the same, its file overwritten with the curve a busy hour left (calibrated values
  right, refined ones 100x too dear at 2-9 rows; the issue's table), then one run;
- x100: the same, every multi-row time in its file (calibrated and refined) 100x dearer;
- after load: the healthy cache, one generation with busy loops on every core (its figures
  are printed too), then one run on the idle machine;
- load first: an empty cache whose first generation (and calibration) ran beside busy loops
  on every core, then one run on the idle machine.

- healthy after load: the healthy cache, run right after the same spell, in turn with the two
  above: what the machine itself kept of the load;
- plain: plain decoding (`--drafter none`) on the healthy cache, the yardstick of a prompt
  lookup cannot copy from (`--prompt`).

Printed: the median decode tokens/s of each, each run's ratio to the healthy and the plain run
of its repetition (median and lowest), the drafted tokens, the mean accepted length, the state
of the curve the measured run used and the thread count each run ended on.

    .venv/bin/python scripts/bench/costs.py [--target NAME] [--prompt ID] [--max-tokens 160] [--repeat 3] [--exact]
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


def prompt_text(prompt_id: str) -> str:
    with open(ROOT / "data" / "prompts.jsonl", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row["id"] == prompt_id:
                return row["prompt"]
    raise SystemExit(f"no prompt {prompt_id!r} in data/prompts.jsonl")


def generate(args, costs: Path, drafter: str = "pld") -> dict:
    argv = [sys.executable, "-m", "flylocal", "generate", prompt_text(args.prompt), "--target", args.target,
            "--max-tokens", str(args.max_tokens), "--verifier", "strict", "--drafter", drafter, "--json"]
    env = dict(os.environ, FLYLOCAL_COSTS=str(costs), FLYLOCAL_EXACT="1" if args.exact else "0")
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, timeout=LOAD_LIMIT_S)
    data = json.loads(out.stdout)
    return data["stats"] | {"thread_use": data.get("thread_use") or {}}


def healthy_cache(args, folder: Path) -> Path:
    """A cache whose curve settled on the idle machine (calibrated again until it does)."""
    for _ in range(5):
        shutil.rmtree(folder, ignore_errors=True)
        generate(args, folder)        # measures the curve after its answer (in slices before it)
        if generate(args, folder)["cost_curve"]["state"] == "settled":
            return folder
    raise SystemExit("the cost curve did not settle in 5 tries: is the machine idle?")


def scale(data: dict, factor: float) -> dict:
    """A format-2 cache file with every multi-row time (calibrated and refined) `factor` times
    dearer: the issue's poisoning."""
    cal = data["calibration"]
    cal["seconds"] = [v if v is None or i == 0 else v * factor for i, v in enumerate(cal["seconds"])]
    data["refined"] = [v if v is None or i == 0 else v * factor for i, v in enumerate(data.get("refined", []))]
    return data


def copy(src: Path, dst: Path) -> Path:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst


def counts(stats: list[dict]) -> str:
    """The thread counts the runs ended on, and their ratios, in one cell."""
    return " ".join(str(s["thread_use"].get("count", "?")) for s in stats)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--prompt", default=PROMPT_ID, help="a prompt id of data/prompts.jsonl")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--exact", action="store_true", help="the batch-invariant build")
    ap.add_argument("--json", type=Path, help="write every run's stats here too")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))      # the load is stopped on the way out
    cores = sorted(os.sched_getaffinity(0))
    work = Path(tempfile.mkdtemp(prefix="flylocal-bench-costs-"))
    try:
        healthy = healthy_cache(args, work / "healthy")
        runs: dict[str, list[dict]] = {"plain": [], "healthy": [], "poisoned": [], "x100": [], "after load": [],
                                       "load first": [], "healthy after load": []}
        loaded: list[dict] = []
        for rep in range(args.repeat):
            runs["plain"].append(generate(args, healthy, drafter="none"))
            runs["healthy"].append(generate(args, healthy))
            poisoned = copy(healthy, work / "poisoned")
            for path in poisoned.glob("*.json"):
                if path.name != "threads.json":
                    key = json.loads(path.read_text())["key"]
                    path.write_text(json.dumps({"format": 1, "key": key, **POISON}))
            runs["poisoned"].append(generate(args, poisoned))
            scaled = copy(healthy, work / "scaled")
            for path in scaled.glob("*.json"):
                if path.name != "threads.json":
                    path.write_text(json.dumps(scale(json.loads(path.read_text()), 100)))
            runs["x100"].append(generate(args, scaled))
            after = copy(healthy, work / "after")
            first = work / "first"
            shutil.rmtree(first, ignore_errors=True)
            with busy(cores):
                loaded.append(generate(args, after))
                loaded.append(generate(args, first))
            # In turn, after the spell: a cache the spell did not touch is the yardstick of what
            # the machine itself kept of the load (its clocks, its caches).
            after_spell = [("after load", after), ("load first", first), ("healthy after load", healthy)]
            for name, folder in after_spell[rep % 3:] + after_spell[: rep % 3]:
                runs[name].append(generate(args, folder))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "loaded": loaded}))
    build = "exact" if args.exact else "fast"
    print(f"target {args.target}, {build} build, prompt {args.prompt}, strict-pld, {args.max_tokens} tokens, "
          f"{len(cores)} cores, repeat {args.repeat}; decode tokens/s, median; each run against the healthy and "
          f"plain runs of its own repetition: median, lowest")
    print("| cache | decode tok/s | / healthy | lowest | / plain | lowest | drafted | mean accepted length | "
          "curve state | threads at the end |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, stats in [*runs.items(), ("(the runs beside busy loops on every core)", loaded)]:
        print(row(name, stats, runs))
    return 0


def row(name: str, stats: list[dict], runs: dict[str, list[dict]]) -> str:
    """One line of the table: `stats`' speeds, and each one's ratio to the same repetition's
    healthy and plain runs (the loaded runs come two a repetition)."""
    per = max(len(stats) // len(runs["healthy"]), 1)
    ratios = {}
    for against in ("healthy", "plain"):
        ratios[against] = [s["tokens_per_s"] / runs[against][i // per]["tokens_per_s"] for i, s in enumerate(stats)]
    states = ", ".join(sorted({(s["cost_curve"] or {}).get("state", "none") for s in stats}))
    cells = [f"{statistics.median(s['tokens_per_s'] for s in stats):.1f}"]
    for against in ("healthy", "plain"):
        cells += [f"{statistics.median(ratios[against]):.2f}", f"{min(ratios[against]):.2f}"]
    cells += [f"{statistics.median(s['drafted'] for s in stats):.0f}",
              f"{statistics.median(s['mean_accepted_length'] for s in stats):.2f}", states, counts(stats)]
    return f"| {name} | " + " | ".join(cells) + " |"


if __name__ == "__main__":
    sys.exit(main())
