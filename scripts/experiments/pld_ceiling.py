"""How close prompt lookup's draft-length control comes to the best possible, on Spec-Bench.

Strict decoding is deterministic, so once the target's greedy output for a prompt is known,
every round of a prompt-lookup run can be replayed without the model: at each position the
lookup proposal is a function of the context, and the accepted length is its agreement with
the known output. Given this machine's cost curve t(n) (the one the engine uses), the script
compares, in decode time against plain decoding:

- the controller flylocal runs (flylocal.decoding.adaptive.DraftLength, as in the engine);
- the best fixed draft length per confidence level, chosen in hindsight on these prompts;
- an oracle that knows how many proposed tokens will be accepted and drafts exactly those:
  a ceiling no controller that sees only the proposal can reach.

It also prints the acceptance each confidence level really had when every proposed token was
verified (per position, and right after a fully accepted round), the evidence the drafter's
priors (flylocal.decoding.drafters.pld.level_prior) are set from. `--skip N` leaves out the
first N prompts of each group, the ones `flylocal bench serve` answers, so that priors are
measured on prompts held apart from the benchmark that judges them. `--context N` pads each
question to about N tokens with other questions' texts (as `flylocal bench serve --context`
does), and adds a table end to end: each prompt's prefill, timed here, before its decode.

    .venv/bin/python scripts/experiments/pld_ceiling.py [--target NAME] [--raw] [--per-category 16] [--skip 8] [--max-tokens 128] [--exact] [--context 1024]

Answered (docs/benchmarks.md, "How far prompt lookup, and trees, can go", 2026-11-30): on the default
target flylocal's controller reached 1.047x plain decoding, the best fixed length per level in
hindsight 1.041x, the oracle 1.115x (its Q4_0 requant: 1.192, 1.206, 1.562). The controller is
at the best fixed lengths; the oracle's gap is what no controller that sees only the proposal
can close.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # scripts/bench's shared helpers (harness)
import replay


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default=str(replay.harness.ROOT / "data" / "spec_bench"))
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--per-category", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--raw", action="store_true", help="ask 'Question: ...\\nAnswer:' (a base model)")
    ap.add_argument("--k", type=int, default=8, help="the controller's longest draft")
    ap.add_argument("--skip", type=int, default=0, help="leave out the first N prompts of each group")
    ap.add_argument("--context", type=int, help="pad each question to about N tokens with other questions' texts")
    ap.add_argument("--answers", help="a .npz file the greedy answers are kept in (read when it exists)")
    ap.add_argument("--exact", action="store_true", help="the batch-invariant build")
    args = ap.parse_args()

    from flylocal.llama import kernels
    kernels.choose(args.exact)

    from flylocal.decoding.adaptive import DraftLength, timed_decode
    from flylocal.decoding.drafters.pld import PromptLookup, level_prior
    from flylocal.loader import load
    from flylocal.settings import Settings

    ctx = (args.context or 0) + args.max_tokens + 512
    models = load(Settings(target=args.target, drafter="none", verifier="strict", max_tokens=args.max_tokens,
                           **({"ctx": ctx} if args.context else {})))
    target = models.target
    items = replay.answers(models, args.prompts, args.per_category, args.skip, args.raw, args.answers, args.context)
    target.reset()
    probe = items[0][1]
    target.decode(probe[:-1][: items[0][2] if args.context else 256])      # the curve at the prompts' length
    target.costs.ensure(lambda rows: timed_decode(target, int(probe[0]), rows), max_rows=17, limit=target.n_batch)
    cost = target.costs.cost(17)                                      # [17] t(1..17)
    lookup = PromptLookup(np.zeros(target.n_vocab, dtype=bool))
    prior = level_prior(lookup.max_ngram)                              # [levels]

    prefill = np.zeros(len(items))                                     # [prompts] seconds, with --context
    if args.context:
        for i, (_, full, n0) in enumerate(items):
            target.reset()
            started = time.perf_counter()
            target.decode(full[:n0])
            prefill[i] = time.perf_counter() - started
        target.reset()

    def run(choose, update=lambda *a: None, first=np.zeros(len(items))):
        """({group: speedup}, overall) of a policy; `first`: seconds before decoding, per prompt."""
        per = collections.defaultdict(lambda: [0.0, 0.0])             # group -> plain seconds, seconds
        for (group, full, n0), before in zip(items, first):
            state = {}
            pos, t = n0, 0.0
            while pos < len(full):
                k = min(16, len(full) - pos - 1)
                prop = lookup.propose(full[:pos], k) if k > 0 else None
                truth = full[pos: pos + len(prop.tokens)] if prop is not None else full[:0]
                agree = 0
                while prop is not None and agree < len(prop.tokens) and prop.tokens[agree] == truth[agree]:
                    agree += 1
                kk = choose(state, prop, agree) if prop is not None and len(prop.tokens) else 0
                accepted = min(agree, kk)
                update(state, prop, kk, accepted)
                t += cost[kk]
                pos += accepted + 1
            per[group][0] += (len(full) - n0) * cost[0] + before
            per[group][1] += t + before
        overall = sum(a for a, _ in per.values()) / sum(b for _, b in per.values())
        return {g: a / b for g, (a, b) in per.items()}, overall

    def controller(state, prop, agree):
        state.setdefault("dl", DraftLength(args.k, prior, target.costs))
        return state["dl"].choose(prop.level, len(prop.tokens))

    def controller_update(state, prop, kk, accepted):
        if "dl" in state:
            state["dl"].update(prop.level if prop is not None else 0, kk, accepted)

    levels = range(len(prior))
    print("acceptance when every proposed token is verified (positions 1..4; rounds):")
    print("| level | prior | after a full accept | p1 | p2 | p3 | p4 | rounds |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    hits = np.zeros((2, len(levels), args.k))
    tries = np.zeros((2, len(levels), args.k))
    for _, full, n0 in items:
        pos, streak = n0, 0
        while pos < len(full) - 1:
            prop = lookup.propose(full[:pos], min(args.k, len(full) - pos - 1))
            if not len(prop.tokens):
                pos, streak = pos + 1, 0
                continue
            truth = full[pos: pos + len(prop.tokens)]
            agree = int(np.argmin(np.append(prop.tokens == truth, False)))
            reached = min(agree + 1, len(prop.tokens))
            tries[streak, prop.level, :reached] += 1
            hits[streak, prop.level, :agree] += 1
            streak = int(agree == len(prop.tokens))
            pos += agree + 1
    for level in levels:
        for streak in (0, 1):
            t, h = tries[streak, level], hits[streak, level]
            cells = " | ".join(f"{h[i] / t[i]:.2f}" if t[i] else "-" for i in range(4))
            print(f"| {level} | {prior[level]:.2f} | {'yes' if streak else 'no'} | {cells} | {int(t[0])} |")
    best: dict[int, int] = {}
    for level in levels:            # the best fixed length per level, one level at a time
        scores = {k: run(lambda s, p, a, m={**best, level: k}: min(m.get(p.level, 0), len(p.tokens)))[1]
                  for k in (0, 2, 3, 4, 6, 8, 12, 16)}
        best[level] = max(scores, key=scores.get)

    rows = [("controller (flylocal)", run(controller, controller_update)),
            (f"best fixed length per level {best}", run(lambda s, p, a: min(best.get(p.level, 0), len(p.tokens)))),
            ("oracle: drafts exactly what will be accepted", run(lambda s, p, a: a))]
    replay.table(rows, cost, len(items), kernels.mode())
    if args.context:            # the prompt's prefill, timed here, is the same for every policy
        print(f"prefill: {np.median(prefill):.2f} s a prompt (median), {np.median(prefill) / cost[0]:.0f} plain steps")
        rows = [(name, run(choose, update, prefill)) for name, (choose, update) in
                (("controller (flylocal)", (controller, controller_update)),
                 ("oracle: drafts exactly what will be accepted", (lambda s, p, a: a, lambda *a: None)))]
        replay.table(rows, cost, len(items), kernels.mode(), what="end-to-end")
    models.close()


if __name__ == "__main__":
    main()
