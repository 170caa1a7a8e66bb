"""What a draft model's bounded context costs in acceptance, and what it saves in time
(docs/design.md, "The draft window"): Spec-Bench questions held out, padded to each context
length with other questions' whole texts (as `flylocal bench serve --context N`), drafted by
the draft model alone at a fixed k, verified strictly, once per --draft-window.

    .venv/bin/python scripts/experiments/draft_window.py [--preset standin|standin-instruct]
        [--contexts 1024,4096,8192] [--windows 256,1024,0] [--per-category 1] [--max-tokens 64] [--k 4]

Prints, per context and window: the mean accepted length per round (of k), the share of
drafted tokens accepted, the draft model's prefill (tokens, seconds) and its single-token draft
steps (ms, median). Window 0 reads the whole context.
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
from flylocal.decoding.engine import generate_all
from flylocal.front.bench.questions import conversations
from flylocal.front.bench.prompts import BASE_FORM
from flylocal.settings import PRESETS, Settings


def timed(runtime, log: list):
    """Record (rows, seconds) of every decode of `runtime`."""
    decode = runtime.decode

    def wrapped(tokens, logits_from=None):
        t0 = time.perf_counter()
        out = decode(tokens, logits_from)
        log.append((len(tokens), time.perf_counter() - t0))
        return out

    runtime.decode = wrapped


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=tuple(PRESETS), default="standin")
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--windows", default="256,1024,0")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    preset = PRESETS[args.preset]
    contexts = [int(c) for c in args.contexts.split(",")]
    windows = [int(w) for w in args.windows.split(",")]
    base = Settings(target=preset.target, draft=preset.draft, threads=args.threads, max_tokens=args.max_tokens,
                    ctx=max(contexts) + args.max_tokens + 256, drafter="model", verifier="strict", k=args.k)
    models = loader.load(base)
    count = lambda text: len(models.target.tokenize(text, add_special=False))      # noqa: E731
    log: list = []
    timed(models.draft, log)
    print(f"{args.preset}: {preset.target}, draft {preset.draft}; k = {args.k}, {args.max_tokens} tokens, "
          f"{args.threads} threads")
    print("| context | window | questions | accepted / round | drafted accepted | draft prefill tokens | "
          "prefill s | draft step ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in contexts:
        convs = conversations(None, None, args.per_category, args.skip, 1, None, 1, n, count)
        prompts = []
        for _, (turn,) in convs:
            text = BASE_FORM.format(turn) if preset.base_model else turn
            prompts.append(loader.encode_prompt(models.target, text, raw=preset.base_model)[0])
        for w in windows:
            s = dataclasses.replace(base, draft_window=w)
            accepted = drafted = rounds = 0
            prefill_tokens, prefill_s, steps = [], [], []
            for ids in prompts:
                models.draft.reset()
                del log[:]
                _, stats, _ = generate_all(models.engine(s, private=True), ids)
                accepted, drafted, rounds = accepted + stats.accepted, drafted + stats.drafted, rounds + stats.rounds
                big = [(r, t) for r, t in log if r > 16]
                prefill_tokens.append(sum(r for r, _ in big))
                prefill_s.append(sum(t for _, t in big))
                steps += [t for r, t in log if r == 1]
            print(f"| {n:,} | {w or 'all'} | {len(prompts)} | {accepted / max(rounds, 1):.2f} | "
                  f"{accepted / max(drafted, 1):.1%} | {np.mean(prefill_tokens):,.0f} | {np.mean(prefill_s):.2f} | "
                  f"{np.median(steps) * 1000:.2f} |", flush=True)


if __name__ == "__main__":
    main()
