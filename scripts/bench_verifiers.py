#!/usr/bin/env python3
"""Verifiers side by side (strict, FLy, ASD) with the draft model and with MLA, in one process.

For each method it reports, over the prompts: mean accepted length (tau), decode tokens/s and
the speedup over plain autoregressive decoding, the share of outputs identical to the
autoregressive output (greedy decoding at temperature 0), where the others first diverge, and the target's own judgement of the text (mean
negative log-likelihood per token). Methods run interleaved per prompt and repeat, so a
drifting machine affects all alike. A second part measures the verifier's share of a round on
Gemma-3-270M at k = 16.

    .venv/bin/python scripts/bench_verifiers.py [--repeat 2] [--max-tokens 128] [--k 10]
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
from flylocal.sampling import SamplingParams

ARTICLE = (
    "The city council voted on Monday to expand the bike lane network across the downtown area. The plan adds "
    "twelve miles of protected lanes over the next two years, funded by a state transportation grant. Supporters "
    "said the lanes would make cycling safer, while some business owners worried about losing parking spaces."
)
REPORT = (
    "Quarterly sales rose eight percent, driven by strong demand for the new laptop line in Europe. Costs also "
    "increased because of higher shipping prices, so profit grew only two percent. The company expects the "
    "shipping costs to fall next quarter and plans to hire forty engineers."
)
PROMPTS = {
    "summarise-1": f"Summarize this article in two sentences:\n\n{ARTICLE}",
    "summarise-2": f"Summarize the key points of this report:\n\n{REPORT}",
    "reply-1": ("Write a short, polite reply to this email: 'Hi, could we move our meeting from Tuesday to "
                "Thursday afternoon? Something came up. Thanks, Anna'"),
    "reply-2": ("Write a reply to a customer who says their order arrived damaged and asks for a refund."),
    "chat-1": "What are some good ways to stay focused while working from home?",
    "chat-2": "Can you explain why the sky is blue in simple terms?",
}
METHODS = [("strict", "none"), ("strict", "model"), ("fly", "model"), ("asd", "model"),
           ("strict", "mla"), ("fly", "mla"), ("asd", "mla")]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def quality_table(args) -> None:
    rconf = RuntimeConfig(n_ctx=2048, n_threads=args.threads)
    target = Runtime(resolve("smollm2-135m-instruct"), rconf)
    draft = Runtime(resolve("smollm2-135m-instruct-q4_0"), rconf)
    base = Settings(k=args.k, max_tokens=args.max_tokens,
                    sampling=SamplingParams(temperature=args.temperature, seed=args.seed))
    rows = {m: {"tau": [], "tps": [], "same": 0, "div": [], "loose": 0, "mism": 0, "nll": []} for m in METHODS}
    for name, text in PROMPTS.items():
        ids, _ = encode_prompt(target, text, raw=False)
        outputs = {}
        for _ in range(args.repeat):
            for verifier, drafter in METHODS:
                target.reset()
                draft.reset()
                engine = build_engine(dataclasses.replace(base, drafter=drafter, verifier=verifier), target, draft)
                tokens, stats, _ = generate_all(engine, ids)
                r = rows[(verifier, drafter)]
                r["tau"].append(stats.mean_accepted_length)
                r["tps"].append(stats.tokens_per_s)
                outputs[(verifier, drafter)] = tokens
                r["loose"] += stats.loose
                r["mism"] += stats.mismatches
        greedy = outputs[("strict", "none")]
        for m, tokens in outputs.items():
            d = first_divergence(tokens, greedy)
            rows[m]["same"] += d is None
            if d is not None:
                rows[m]["div"].append(d)
            rows[m]["nll"].append(target_nll(target, ids, tokens))
        print(f"  {name}: done", file=sys.stderr)
    n = len(PROMPTS)
    print(f"SmolLM2-135M-Instruct target, Q4_0 draft, k {args.k}, max_tokens {args.max_tokens}, "
          f"{n} prompts x {args.repeat} repeats, temperature {args.temperature}")
    print("| method | tau | tokens/s | speedup | identical to greedy | first divergence (median token) "
          "| loose / mismatches | target NLL |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    plain = statistics.median(rows[("strict", "none")]["tps"])
    for (verifier, drafter), r in rows.items():
        div = f"{statistics.median(r['div']):.0f}" if r["div"] else "-"
        name = "autoregressive" if drafter == "none" else f"{verifier}-{drafter}"
        tps = statistics.median(r["tps"])
        print(f"| {name} | {statistics.mean(r['tau']):.2f} | {tps:.1f} | {tps / plain:.2f}x | {r['same']}/{n} | "
              f"{div} | {r['loose']}/{r['mism']} | {statistics.mean(r['nll']):.3f} |")
    target.close()
    draft.close()


def verify_share(args) -> None:
    rconf = RuntimeConfig(n_ctx=2048, n_threads=args.threads)
    target = Runtime(resolve("gemma-3-270m"), rconf)
    draft = Runtime(resolve("gemma-3-270m-q8_0"), rconf)
    ids = target.tokenize("The river runs through the valley and past the mill. " * 6 + "One morning the miller")
    print(f"\nGemma-3-270M target (Q4_K_M, vocab {target.n_vocab}), its Q8_0 requant as draft model, "
          f"k 16, 96 tokens")
    print("| verifier | rounds | drafted | verify ms/round | round ms | verify share |")
    print("| --- | --- | --- | --- | --- | --- |")
    for verifier in ("strict", "fly", "asd"):
        target.reset()
        draft.reset()
        engine = build_engine(Settings(target="gemma-3-270m", drafter="model", verifier=verifier, k=16,
                                       max_tokens=96), target, draft)
        _, s, _ = generate_all(engine, ids)
        round_ms = 1000 * s.decode_s / s.rounds
        verify_ms = 1000 * s.verify_s / s.rounds
        print(f"| {verifier} | {s.rounds} | {s.drafted} | {verify_ms:.2f} | {round_ms:.1f} | "
              f"{100 * verify_ms / round_ms:.1f}% |")
    target.close()
    draft.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample (top-k 40, top-p 0.95, min-p 0.05) instead of greedy decoding")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-verify-share", action="store_true", help="skip the Gemma verify-share table")
    args = ap.parse_args()
    quality_table(args)
    if not args.no_verify_share:
        verify_share(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
