#!/usr/bin/env python3
"""Prompt lookup + strict against plain autoregressive decoding, in one process.

Runs each prompt with `--drafter none` and `--drafter pld` (strict), interleaved, R times, on
one loaded target, and prints the decode tokens/s of each and their ratio. Outputs are also
checked to be identical (strict is lossless). Speed is noisy: read the ratios, which are
measured side by side.

    .venv/bin/python scripts/bench_pld.py [--target NAME] [--repeat 5] [--max-tokens 128] [--k N]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

from flylocal.decoding.engine import generate_all
from flylocal.front.bench import load_prompts
from flylocal.llama.runtime import Runtime, RuntimeConfig
from flylocal.loader import build_engine, encode_prompt
from flylocal.models import resolve
from flylocal.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
# label -> the prompt of that id in data/prompts.jsonl
PROMPTS = {label: p.text for label, pid in {'copy-edit': 'copy-edit-keeper', 'summarise': 'summarise-council', 'own-words': 'story-robot'}.items()
           for p in load_prompts(str(ROOT / "data" / "prompts.jsonl")) if p.id == pid}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=None, help="fixed draft length (default: adaptive)")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()

    target = Runtime(resolve(args.target), RuntimeConfig(n_ctx=2048, n_threads=args.threads))
    base = Settings(target=args.target, verifier="strict", k=args.k, max_tokens=args.max_tokens)
    print(f"target {target.name}, max_tokens {args.max_tokens}, k {'adaptive' if args.k is None else args.k}, "
          f"repeat {args.repeat}")
    print(f"{'prompt':10} {'none tok/s':>11} {'pld tok/s':>10} {'ratio':>6} {'tau':>5} {'identical':>9} "
          f"{'loop us/round':>14}")
    for label, text in PROMPTS.items():
        ids, _ = encode_prompt(target, text, raw=False)
        speed = {"none": [], "pld": []}
        tau, outputs, loop = [], {}, []
        for _ in range(args.repeat):
            for drafter in ("none", "pld"):
                target.reset()  # every run evaluates its prompt afresh
                engine = build_engine(dataclasses.replace(base, drafter=drafter), target, None)
                tokens, stats, _ = generate_all(engine, ids)
                speed[drafter].append(stats.tokens_per_s)
                outputs.setdefault(drafter, tokens)
                if drafter == "pld":
                    tau.append(stats.mean_accepted_length)
                # Python time per round outside llama.cpp decode, drafting and verification.
                rest = stats.decode_s - stats.target_s - stats.draft_s - stats.verify_s
                loop.append(1e6 * rest / stats.rounds)
        none, pld = statistics.median(speed["none"]), statistics.median(speed["pld"])
        same = outputs["none"] == outputs["pld"]
        print(f"{label:10} {none:11.1f} {pld:10.1f} {pld / none:6.2f} {statistics.median(tau):5.2f} {str(same):>9} "
              f"{statistics.median(loop):14.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
