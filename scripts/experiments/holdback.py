"""What holding text back costs: FLy's window across rounds keeps the output from a provisional
token on until its window closes (docs/verifiers.md, "FLy"). For each output token, the delay is
the time from the round that committed it for good to the event that showed it; for the
method's whole answer, time to each token against FLy within rounds and strict.

    .venv/bin/python scripts/experiments/holdback.py [--preset standin|default] [--per-category 1] [--max-tokens 128]

Prints, per method: tokens, the share of tokens shown late, the delay's median, 95th percentile
and maximum over tokens (ms), and the mean time to a token (ms from the start of decoding).

Answered (docs/benchmarks.md, "What does FLy (and ASD) buy?", "What holding text back
costs"): on the stand-in fly-pld across rounds showed 2.6% of its tokens late, 76 ms at the
median (p95 198 ms, at most 218), and none late on the default target: the window's hold costs
a reader little.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # scripts/bench's shared helpers (harness)
import harness  # noqa: F401 - puts the project on the import path
import numpy as np

from flylocal import loader
from flylocal.decoding.verifiers import VerifierConfig
from flylocal.decoding.verifiers.fly import FlyParams
from flylocal.front.bench.prompts import per_group, load_prompts, standin_prompts, data_dir
from flylocal.settings import Settings, STANDIN_DRAFT, STANDIN_TARGET

METHODS = {"strict-pld": ("strict", FlyParams()), "fly-within-pld": ("fly", FlyParams(across=False, candidates=False)),
           "fly-pld": ("fly", FlyParams())}


def run(models, settings: Settings, ids: np.ndarray) -> tuple[list[float], list[float]]:
    """(per output token: seconds from committed to shown, seconds from the first round to shown)."""
    gen = models.engine(settings, private=True).generate(ids)
    commit_t: list[float] = []          # per output index: when the token that stays there was committed
    shown_t: list[float] = []           # per output index: when it was shown
    start = None
    for event in gen:
        t = time.perf_counter()
        start = start if start is not None else t
        tr = event.trace
        if tr.get("retracted"):
            del commit_t[len(shown_t):]       # everything not shown was held back, and is taken back
        shown_t += [t] * len(event.tokens)
        length = len(shown_t) + tr.get("held", 0)   # output committed so far
        del commit_t[length:]
        commit_t += [t] * (length - len(commit_t))
    n = len(shown_t)
    return [shown_t[i] - commit_t[i] for i in range(n)], [s - start for s in shown_t]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=("standin", "default"), default="standin")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.preset == "standin":
        prompts = standin_prompts(args.per_category)
        base = Settings(target=STANDIN_TARGET, draft=STANDIN_DRAFT, threads=args.threads, max_tokens=args.max_tokens,
                        trace=True)
    else:
        prompts = per_group(load_prompts(str(data_dir() / "spec_bench")), args.per_category)
        base = Settings(threads=args.threads, max_tokens=args.max_tokens, trace=True)
    models = loader.load(base)
    results = {m: ([], []) for m in METHODS}
    for p in prompts:
        ids, _ = loader.encode_prompt(models.target, p.text, raw=p.raw)
        for m, (verifier, fly) in METHODS.items():
            s = dataclasses.replace(base, verifier=verifier, drafter="pld", verifiers=VerifierConfig(fly=fly))
            delays, times = run(models, s, ids)
            results[m][0].extend(delays)
            results[m][1].extend(times)
    print(f"{len(prompts)} prompts, {args.max_tokens} tokens, {args.preset} target, {args.threads} threads")
    print("| method | tokens | shown late | delay median / p95 / max (ms) | mean time to a token (ms) |")
    print("| --- | --- | --- | --- | --- |")
    for m, (delays, times) in results.items():
        d = np.array(delays) * 1000
        late = d > 0
        med, p95 = (np.median(d[late]), np.percentile(d[late], 95)) if late.any() else (0.0, 0.0)
        print(f"| {m} | {len(d)} | {late.mean():.1%} | {med:.0f} / {p95:.0f} / {d.max():.0f} | "
              f"{np.mean(times) * 1000:.0f} |")


if __name__ == "__main__":
    main()
