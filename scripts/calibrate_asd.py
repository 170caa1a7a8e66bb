#!/usr/bin/env python3
"""Choose ASD's defaults by measurement, on prompts kept apart from the tests and benchmarks
(the `held-apart` category of data/prompts.jsonl): a preset of `flylocal bench`.

For each setting (g, M, B) it runs SmolLM2-135M-Instruct with its Q4_0 draft model (k 10) and
reports the mean accepted length against strict's, the target's NLL of the text, the drift from
autoregressive decoding (identical outputs, median first divergence) and the regret spent.

    .venv/bin/python scripts/calibrate_asd.py [--max-tokens 96] [--k 10]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPTS = Path(__file__).resolve().parent.parent / "data" / "prompts.jsonl"
SETTINGS = [  # (g, M, B)
    (0.05, 1, 4.0), (0.1, 1, 4.0), (0.25, 1, 4.0),
    (0.1, 2, 4.0), (0.1, 1, 2.0), (0.1, 1, 8.0),
    (0.5, 2, 16.0),
]


def bench(out: Path, methods: str, args, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "flylocal", "bench", "--prompts", str(PROMPTS), "--category", "held-apart",
           "--draft", "smollm2-135m-instruct-q4_0", "--methods", methods, "--k", args.k,
           "--max-tokens", args.max_tokens, "--out", str(out), *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return {r["method"]: r for r in json.loads((out / "results.json").read_text())["methods"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", default="96")
    ap.add_argument("--k", default="10")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="flylocal-calibrate-asd-"))
    strict = bench(work / "strict", "strict-model", args)["strict-model"]
    print(f"held-apart prompts: {strict['completed']}, k {args.k}, max_tokens {args.max_tokens}; strict tau "
          f"{strict['mean_accepted_length']:.2f}, target NLL {strict['target_nll']:.3f} nats/token")
    print("| g | M | B | tau | tau gain | target NLL (strict +) | identical to greedy | median first divergence "
          "| mean regret spent |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for i, (g, m, b) in enumerate(SETTINGS):
        asd = bench(work / f"asd-{i}", "autoregressive,asd-model", args, "--asd-gate", str(g), "--asd-cap", str(m),
                    "--asd-budget", str(b))["asd-model"]
        tau, nll, div = asd["mean_accepted_length"], asd["target_nll"], asd["first_divergence"]
        print(f"| {g} | {m} | {b:g} | {tau:.2f} | {100 * (tau / strict['mean_accepted_length'] - 1):+.1f}% | "
              f"{nll:.3f} ({nll - strict['target_nll']:+.3f}) | {asd['agreement']:.0%} | "
              f"{'-' if div is None else f'{div:.0f}'} | {asd['budget_spent'] or 0:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
