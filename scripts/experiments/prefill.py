"""What a long prompt's prefill costs under each llama.cpp setting flylocal controls: the batch
size (llama.cpp's n_batch and n_ubatch, which flylocal sets alike), flash attention, the KV
cells' types and the thread count, at each context length; and the first single step after
it, which pays for the cells' reads.

    .venv/bin/python scripts/experiments/prefill.py [--model gemma-3-270m-f32] [--lengths 1024,4096,8192]
        [--repeat 3]

Prints per setting and length the prefill's seconds (median of --repeat, the settings taking
turns) and tokens/s, and a single step's ms after it. The text is Spec-Bench's questions, one
after another (real text, nothing repeated).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # scripts/bench's shared helpers (harness)
import harness  # noqa: F401 - puts the project on the import path
import numpy as np

from flylocal import models
from flylocal.front.bench.prompts import data_dir, load_prompts

SETTINGS = {   # name: RuntimeConfig fields
    "batch 512 (default)": {},
    "batch 256": {"n_batch": 256},
    "batch 1024": {"n_batch": 1024},
    "batch 2048": {"n_batch": 2048},
    "fa off": {"flash_attn": "off"},
    "fa on": {"flash_attn": "on"},
    "cells q8_0": {"type_k": "q8_0", "type_v": "q8_0", "flash_attn": "on"},
    "threads 1": {"n_threads": 1},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma-3-270m-f32")
    ap.add_argument("--lengths", default="1024,4096,8192")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--rows", default="", help="also: a decode of each of these row counts after each length "
                    "(the cost curve's shape by context), the default setting, median of 7")
    args = ap.parse_args()
    from flylocal.llama.runtime import Runtime, RuntimeConfig   # llama.cpp once asked to run (--help needs none)

    lengths = [int(n) for n in args.lengths.split(",")]
    chosen = [s for s in args.settings.split(",") if s in SETTINGS]
    path = models.resolve(args.model)
    text = "\n\n".join(p.text for p in load_prompts(str(data_dir() / "spec_bench")))
    got: dict = {(s, n): ([], []) for s in chosen for n in lengths}
    for _ in range(args.repeat):
        for s in chosen:
            config = RuntimeConfig(**({"n_ctx": max(lengths) + 64, "n_threads": args.threads} | SETTINGS[s]))
            rt = Runtime(path, config)
            ids = rt.tokenize(text)
            for n in lengths:
                rt.reset()
                t0 = time.perf_counter()
                rt.decode(ids[: n - 1])
                rt.decode(ids[n - 1 : n], logits_from=0)
                t1 = time.perf_counter()
                rt.decode(ids[n : n + 1], logits_from=0)
                got[s, n][0].append(t1 - t0)
                got[s, n][1].append(time.perf_counter() - t1)
            rt.close()
    print(f"{args.model}, {args.threads} threads, median of {args.repeat}")
    print("| setting | " + " | ".join(f"{n:,}: prefill s (tok/s), step ms" for n in lengths) + " |")
    print("| --- | " + " | ".join("---" for _ in lengths) + " |")
    for s in chosen:
        cells = []
        for n in lengths:
            pre, step = statistics.median(got[s, n][0]), statistics.median(got[s, n][1])
            cells.append(f"{pre:.2f} ({n / pre:,.0f}), {step * 1000:.1f}")
        print(f"| {s} | " + " | ".join(cells) + " |", flush=True)
    if args.rows:
        by_context(path, text, lengths, [int(r) for r in args.rows.split(",")], args.threads)


def by_context(path, text: str, lengths: list[int], rows: list[int], threads: int) -> None:
    """A decode of r rows after n cached tokens, for each n and r: ms, and in single steps at n."""
    from flylocal.llama.runtime import Runtime, RuntimeConfig

    rt = Runtime(path, RuntimeConfig(n_ctx=max(lengths) + max(rows) + 64, n_threads=threads))
    ids = rt.tokenize(text)
    print("\n| cached | " + " | ".join(f"{r} rows ms (steps)" for r in rows) + " |")
    print("| --- | " + " | ".join("---" for _ in rows) + " |")
    for n in lengths:
        rt.reset()
        rt.decode(ids[:n])
        times = {r: [] for r in rows}
        for _ in range(7):
            for r in rows:
                t0 = time.perf_counter()
                rt.decode(ids[n : n + r], logits_from=0)
                times[r].append(time.perf_counter() - t0)
                rt.truncate(n)
        med = {r: statistics.median(times[r]) for r in rows}
        one = med[rows[0]]
        print(f"| {n:,} | " + " | ".join(f"{med[r] * 1000:.1f} ({med[r] / one:.2f})" for r in rows) + " |", flush=True)
    rt.close()


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
