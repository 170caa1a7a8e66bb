"""KV cache cell types (--cache-type-k / --cache-type-v): what each costs in speed and fidelity
(docs/benchmarks.md, "Conversations taking turns: the prompt cache").

For each type pair, on one model: the bytes a cell takes (an entry of the prompt cache follows
it), the prefill of a --prompt-tokens text (seconds), single decode steps after it (ms), and
fidelity against f16 cells, teacher-forced over --check-tokens tokens of another text: the
share of positions whose argmax is f16's, and the largest and median |Δ logit|. Quantized V
cells need flash attention, so every pair runs with --flash-attn on (the fast build's default
on a CPU); in exact mode only f16/f16 runs without it.

    .venv/bin/python scripts/experiments/cache_types.py [--target NAME] [--pairs f16/f16,q8_0/q8_0,q4_0/q4_0]

Answered (docs/benchmarks.md, "Conversations taking turns: the prompt cache", cell types): on
these CPUs quantized cells cost speed (the prefill 1.1-2.7x slower) for memory; q8_0 keys keep
97-98% of f16's argmax. f16 cells stay the default.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
import time

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # scripts/bench's shared helpers (harness)
from harness import spec_bench_questions


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--pairs", default="f16/f16,q8_0/f16,q8_0/q8_0,q4_0/q4_0")
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--check-tokens", type=int, default=400)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from flylocal import models
    from flylocal.llama.runtime import Runtime, RuntimeConfig

    path = models.resolve(args.target)
    texts = [t for _, t in spec_bench_questions(40)]
    text = "\n\n".join(texts)
    reference = None
    for pair in args.pairs.split(","):
        k, v = pair.split("/")
        config = RuntimeConfig(n_ctx=4096, n_threads=args.threads, flash_attn="on", type_k=k, type_v=v)
        rt = Runtime(path, config)
        try:
            ids = rt.tokenize(text)
            prompt, check = ids[: args.prompt_tokens], ids[args.prompt_tokens: args.prompt_tokens + args.check_tokens]
            prefill, steps = [], []
            for _ in range(args.repeat):
                rt.reset()
                t0 = time.perf_counter()
                rt.decode(prompt)
                prefill.append(time.perf_counter() - t0)
                for t in check[: args.steps]:
                    t0 = time.perf_counter()
                    rt.decode(np.array([t], dtype=np.int32), logits_from=0)
                    steps.append(time.perf_counter() - t0)
            rt.reset()
            rt.decode(prompt)
            logits = rt.decode(check, logits_from=0).copy()            # [check, n_vocab]
            rt.reset()
            rt.decode(prompt[:256])
            size = len(rt.state(0)) / 256 / 1024
        finally:
            rt.close()
        if reference is None:
            reference = logits
        same = float(np.mean(logits.argmax(1) == reference.argmax(1)))
        delta = np.abs(logits - reference).max(1)
        print(f"{args.target} K {k} V {v}: {size:.1f} KiB a token; prefill of {len(prompt)} tokens "
              f"{statistics.median(prefill):.2f} s; a step {1000 * statistics.median(steps):.1f} ms; argmax as f16 "
              f"{100 * same:.1f}% of {len(check)}; |Δ logit| max {delta.max():.2f}, median {np.median(delta):.3f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
