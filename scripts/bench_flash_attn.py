#!/usr/bin/env python3
"""Plain decoding speed with llama.cpp's flash attention on and off, interleaved in one process.

CPU builds run without flash attention because its CPU kernel gives a position other logits
in a batch than alone once the cache passes 256 cells (`flylocal doctor --model M
--flash-attn on` shows it). This measures what that costs.

    .venv/bin/python scripts/bench_flash_attn.py [--repeat 4] [--max-tokens 256]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from bench_pld import PROMPTS
from flylocal.decoding.engine import generate_all
from flylocal.llama.runtime import Runtime, RuntimeConfig
from flylocal.loader import build_engine, encode_prompt
from flylocal.models import resolve
from flylocal.settings import Settings


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    runtimes = {fa: Runtime(resolve(args.target), RuntimeConfig(n_ctx=2048, flash_attn=fa)) for fa in ("on", "off")}
    settings = Settings(drafter="none", verifier="strict", max_tokens=args.max_tokens)
    print(f"{args.target}, plain decoding, {args.max_tokens} tokens, median of {args.repeat}")
    print("| prompt | flash attention on (tok/s) | off (tok/s) | off / on |")
    print("| --- | --- | --- | --- |")
    for label, text in PROMPTS.items():
        speed = {"on": [], "off": []}
        for _ in range(args.repeat):
            for fa, rt in runtimes.items():
                ids, _ = encode_prompt(rt, text, raw=False)
                rt.reset()
                _, stats, _ = generate_all(build_engine(settings, rt, None), ids)
                speed[fa].append(stats.tokens_per_s)
        on, off = statistics.median(speed["on"]), statistics.median(speed["off"])
        print(f"| {label} | {on:.1f} | {off:.1f} | {off / on:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
