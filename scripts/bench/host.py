#!/usr/bin/env python3
"""A round's host work outside llama_decode, against vocabulary size and draft length.

Per round the engine takes a view of the k+1 rows of logits llama.cpp wrote, their argmax
(the target's token at each position), the verifier's decision, one truncate of the cache and
the drafter's next proposal. Each is timed here on real rows of a real model (median of
--repeat), for strict, FLy and ASD, with a draft that matches the target's argmax but at one
position in the middle (so FLy computes one entropy and ASD one regret, as at a mismatch).
The share is of a round whose llama_decode takes --step-ms (about 10 ms for a mid-size model
on a GPU): host / (step + host).

    .venv/bin/python scripts/bench/host.py [--models smollm2-135m-instruct,gemma-3-270m] [--k 1,4,8,16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from harness import ROOT, timed     # first: puts this checkout on sys.path


def measure(name: str, ks: list[int], repeat: int, threads: int | None) -> list[dict]:
    import numpy as np   # after llama.cpp, which main loads first

    from flylocal import models
    from flylocal.decoding.drafters.pld import PromptLookup
    from flylocal.decoding.sampling import SamplingParams, target_argmax
    from flylocal.decoding.verifiers import Asd, Fly, Strict
    from flylocal.llama.binding import llama_cpp
    from flylocal.llama.runtime import Runtime, RuntimeConfig

    rt = Runtime(models.resolve(name), RuntimeConfig(n_ctx=2048, n_threads=threads))
    greedy = SamplingParams()
    text = (ROOT / "README.md").read_text()[:6000]
    context = rt.tokenize(text)[:600]
    rt.decode(context)
    drafter = PromptLookup(rt.eog_mask)
    rows = []
    for k in ks:
        n_past = rt.n_past
        batch = np.concatenate([context[-1:], context[1 : k + 1]]).astype(np.int32)
        logits = rt.decode(batch, logits_from=0)                               # [k+1, V]
        a = logits.argmax(axis=1).astype(np.int32)
        draft = a[:k].copy()
        if k:
            draft[k // 2] = (draft[k // 2] + 1) % rt.n_vocab                 # one mismatch in the middle
        ptr, shape = llama_cpp.llama_get_logits(rt.context._ctx), (k + 1, rt.n_vocab)
        strict, fly, asd = Strict(), Fly(), Asd()
        row = {
            "model": name, "vocab": rt.n_vocab, "k": k,
            "view": timed(lambda: np.ctypeslib.as_array(ptr, shape=shape), repeat),
            "argmax": timed(lambda: target_argmax(draft, logits, context, greedy), repeat),
            "strict": timed(lambda: strict.decide(draft, a, logits), repeat),
            "fly": timed(lambda: fly.decide(draft, a, logits), repeat),
            "asd": timed(lambda: (asd.reset(), asd.decide(draft, a, logits)), repeat),
            "pld": timed(lambda: drafter.propose(context, max(k, 1)), repeat),
        }

        def truncate():                       # the decode is not counted, only the roll back
            rt.truncate(n_past + 1)

        cuts = []
        for _ in range(repeat):
            rt.truncate(n_past)
            rt.decode(batch, logits_from=0)
            t0 = time.perf_counter()
            truncate()
            cuts.append(time.perf_counter() - t0)
        row["truncate"] = statistics.median(cuts)
        rt.truncate(n_past)
        rows.append(row)
    rt.close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma-3-270m")
    ap.add_argument("--k", default="0,1,4,8,16")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    import flylocal.llama.binding  # noqa: F401 - llama.cpp before numpy (flylocal/launch.py says why)

    ks = [int(k) for k in args.k.split(",")]
    print("| model | vocab | k | logits view | argmax | strict | FLy | ASD | truncate | pld | round, strict | "
          "round, FLy | share of a round, FLy |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models.split(","):
        for r in measure(name, ks, args.repeat, args.threads):
            base = r["view"] + r["argmax"] + r["truncate"] + r["pld"]
            us = {key: f"{r[key] * 1e6:.0f} µs" for key in ("view", "argmax", "strict", "fly", "asd", "truncate", "pld")}
            host_s, host_f = base + r["strict"], base + r["fly"]
            share = host_f / (args.step_ms / 1e3 + host_f)
            print(f"| {r['model']} | {r['vocab']:,} | {r['k']} | {us['view']} | {us['argmax']} | {us['strict']} | "
                  f"{us['fly']} | {us['asd']} | {us['truncate']} | {us['pld']} | {host_s * 1e3:.2f} ms | "
                  f"{host_f * 1e3:.2f} ms | {share:.1%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
