#!/usr/bin/env python3
"""What a shared decode costs by its shape, under both cache layouts.

Sequences (4 by default) each hold a prompt of --prompt random tokens; then decodes of the
given shapes run, bare (no verification), --repeat times each, the sequences rolled back after
every one. A shape gives each sequence's rows: `1x4` is four sequences of one row, `9,9,1,1`
two of nine beside two of one, `5` one sequence of five. With a cell stream per sequence (the
default layout) llama.cpp runs an uneven decode as several computations of equal rows per
sequence; with --kv-unified every decode is one computation. Printed: each shape's median
milliseconds per layout and its ratio to one row of one sequence, in rounds that alternate the
layouts.

    .venv/bin/python scripts/experiments/shapes.py [--target gemma-3-270m-f32] [--threads 2]
        [--shapes "1;4;1x4;9,9,1,1"] [--sequences 4] [--prompt 200] [--rounds 3]

Answered (docs/benchmarks.md, "Serving under load", 2026-12-05): on two cores four sequences'
single rows cost 1.83 single steps; an uneven shared decode costs more with a cell stream per
sequence than with --kv-unified (5,1,1,1: 3.80 against 2.27 steps), an even one the same;
padding drafts to even lengths buys nothing here, and a prompt token costs the same in any
chunk on the default target.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

SHAPES = "1;2;4;9;1x4;2x4;4x4;5x4;9x4;5,1,1,1;9,9,1,1;9,1,1,1"


def parse(shape: str) -> list[int]:
    if "x" in shape:
        rows, seqs = shape.split("x")
        return [int(rows)] * int(seqs)
    return [int(r) for r in shape.split(",")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="gemma-3-270m-f32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=200, help="tokens each sequence holds")
    ap.add_argument("--shapes", default=SHAPES, help="';'-separated shapes")
    ap.add_argument("--repeat", type=int, default=15, help="decodes of each shape per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each timing every layout in turn")
    args = ap.parse_args()
    from flylocal import models
    from flylocal.llama.runtime import Runtime, RuntimeConfig

    path = str(models.resolve(args.target))
    shapes = args.shapes.split(";")
    try:
        parsed = [parse(s) for s in shapes]
    except ValueError:
        raise SystemExit(f"shapes.py: --shapes {args.shapes!r}: each shape is rows per sequence, as 5,1,1 or 2x4")
    if any(not rows or min(rows) < 1 for rows in parsed):
        raise SystemExit(f"shapes.py: --shapes {args.shapes!r}: every sequence in a shape decodes at least one row")
    if any(len(rows) > args.sequences for rows in parsed):
        raise SystemExit(f"shapes.py: a shape has more sequences than --sequences {args.sequences}")
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 5000, size=args.prompt).astype(np.int32)
    runtimes = {}
    for unified in (False, True):
        longest = max(max(parse(shape)) for shape in shapes)
        rt = Runtime(path, RuntimeConfig(n_ctx=args.prompt + longest + 64, n_seq=args.sequences, n_threads=args.threads,
                                         kv_unified=unified))
        for s in range(args.sequences):
            for i in range(0, len(prompt), rt.n_batch):
                rt.decode_batch([(s, prompt[i:i + rt.n_batch], None)])
        runtimes["unified" if unified else "streams"] = rt
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for layout, rt in runtimes.items():
            for shape in shapes:
                for _ in range(args.repeat):
                    parts = [(s, rng.integers(100, 5000, size=n).astype(np.int32), 0)
                             for s, n in enumerate(parse(shape))]
                    t0 = time.perf_counter()
                    rt.decode_batch(parts)
                    times.setdefault((layout, shape), []).append(time.perf_counter() - t0)
                    for s, _, _ in parts:
                        rt.sequence(s).truncate(len(prompt))
    print(f"{args.target}, {args.threads} threads, {args.sequences} sequences of {args.prompt} cells: "
          f"median ms (x one row of one sequence)")
    print("| shape | rows | computations (streams) | streams | unified |")
    print("|---|---|---|---|---|")
    one = {layout: statistics.median(times[(layout, "1")]) if (layout, "1") in times else None for layout in runtimes}
    for shape in shapes:
        rows = parse(shape)
        cells = []
        for layout in runtimes:
            ms = statistics.median(times[(layout, shape)]) * 1000
            ratio = f" ({ms / 1000 / one[layout]:.2f})" if one[layout] else ""
            cells.append(f"{ms:.1f}{ratio}")
        split = runtimes["streams"].split(dict(enumerate(rows)))
        print(f"| {shape} | {sum(rows)} | {len(split)} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
