#!/usr/bin/env python3
"""Choose ASD's defaults by measurement, on prompts kept apart from the tests and benchmarks.

For each setting (g, M, B) it runs SmolLM2-135M-Instruct with its Q4_0 draft model (k 10) and
reports the mean accepted length against strict's, and the drift from greedy decoding: the
share of identical outputs, and the median first divergence. All in one process.

    .venv/bin/python scripts/calibrate_asd.py [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

from flylocal.engine import generate_all
from flylocal.loader import Settings, build_engine, encode_prompt
from flylocal.models import resolve
from flylocal.quality import target_nll
from flylocal.runtime import Runtime, RuntimeConfig
from flylocal.verifiers import VerifierConfig
from flylocal.verifiers.asd import AsdParams

HELD_APART = [
    "Summarize in one paragraph: A small bakery in the harbour town started delivering bread by bicycle last "
    "spring. Orders doubled within three months, and the owner hired two students to help on weekends.",
    "Write a friendly note to a neighbour asking them to water your plants while you are away for a week.",
    "Give three tips for learning to play the guitar as an adult.",
    "Explain in simple words how a refrigerator keeps food cold.",
    "Describe a quiet morning at a lake in four sentences.",
]
SETTINGS = [  # (g, M, B)
    (0.05, 1, 4.0), (0.1, 1, 4.0), (0.25, 1, 4.0),
    (0.1, 2, 4.0), (0.1, 1, 2.0), (0.1, 1, 8.0),
    (0.5, 2, 16.0),
]


def first_divergence(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=10)
    args = ap.parse_args()
    rconf = RuntimeConfig(n_ctx=2048)
    target = Runtime(resolve("smollm2-135m-instruct"), rconf)
    draft = Runtime(resolve("smollm2-135m-instruct-q4_0"), rconf)
    base = Settings(drafter="model", k=args.k, max_tokens=args.max_tokens)

    def run(ids, **kw):
        target.reset()
        draft.reset()
        return generate_all(build_engine(dataclasses.replace(base, **kw), target, draft), ids)

    prompts = [encode_prompt(target, p, raw=False)[0] for p in HELD_APART]
    strict_runs = [run(ids, verifier="strict") for ids in prompts]
    strict_tau = statistics.mean(s.mean_accepted_length for _, s, _ in strict_runs)
    strict_nll = statistics.mean(target_nll(target, ids, out) for ids, (out, _, _) in zip(prompts, strict_runs))
    print(f"held-apart prompts: {len(prompts)}, k {args.k}, max_tokens {args.max_tokens}; "
          f"strict tau {strict_tau:.2f}, target NLL {strict_nll:.3f} nats/token")
    print("| g | M | B | tau | tau gain | target NLL (strict +) | identical to greedy | median first divergence "
          "| mean regret spent |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for g, m, b in SETTINGS:
        taus, same, divs, spent, nll = [], 0, [], [], []
        for ids, (greedy, _, _) in zip(prompts, strict_runs):
            tokens, stats, _ = run(ids, verifier="asd",
                                   verifiers=VerifierConfig(asd=AsdParams(gate=g, cap=m, budget=b)))
            taus.append(stats.mean_accepted_length)
            nll.append(target_nll(target, ids, tokens))
            spent.append(stats.budget_spent or 0.0)
            d = first_divergence(tokens, greedy)
            same += d is None
            if d is not None:
                divs.append(d)
        tau = statistics.mean(taus)
        div = f"{statistics.median(divs):.0f}" if divs else "-"
        print(f"| {g} | {m} | {b:g} | {tau:.2f} | {100 * (tau / strict_tau - 1):+.1f}% | "
              f"{statistics.mean(nll):.3f} ({statistics.mean(nll) - strict_nll:+.3f}) | {same}/{len(prompts)} | "
              f"{div} | {statistics.mean(spent):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
