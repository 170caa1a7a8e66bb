#!/usr/bin/env python3
"""The cost curve and the memory of models with every layer offloaded: scripts/device_check.sh's
measuring step, for each model given.

For each model: the GPU memory it takes once loaded with every layer on the GPU and a first
decode made (the GPUs' free memory before and after, from ggml's device API) against what
flylocal predicts for it (`flylocal.llama.placement.fit`, the figure `--gpu-layers auto` places
by); then t(1..33), the seconds of a decode of n rows after a 256-token context, each the median
of 5 after one warm-up, and t(n)/t(1). Without a GPU the memory line says so.

    python scripts/device_measure.py MODEL.gguf [MODEL.gguf ...] [--ctx 4096] [--rows 33]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

GiB = float(1 << 30)


def gpu_free() -> int | None:
    """Free bytes summed over the GPUs; None without one."""
    from flylocal.llama.devices import gpu_offload, local_devices

    gpus = [d for d in local_devices() if d.name != "CPU"] if gpu_offload() else []
    return sum(d.free for d in gpus) if gpus else None


def curve(rt, rows: int, repeats: int = 5) -> list[float]:
    """t(1..rows): the median seconds of a decode of n rows with logits for each, after the
    context, each rolled back."""
    import numpy as np

    n_past, out = rt.n_past, []
    for n in range(1, rows + 1):
        batch = np.full(n, 300, dtype=np.int32)
        runs = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            rt.decode(batch, logits_from=0).argmax(axis=1)
            runs.append(time.perf_counter() - t0)
            rt.truncate(n_past)
        out.append(statistics.median(runs[1:]))
    return out


def measure(path: str, ctx: int, rows: int) -> None:
    from flylocal import models
    from flylocal.llama.placement import ALL, fit
    from flylocal.llama.runtime import Runtime, RuntimeConfig

    layout = models.read_layout(path)
    before = gpu_free()
    rt = Runtime(path, RuntimeConfig(n_ctx=ctx, n_gpu_layers=ALL))
    try:
        rt.decode(rt.tokenize("The quick brown fox jumps over the lazy dog. " * 40)[:256])
        after = gpu_free()
        if before is None or after is None:
            print(f"{rt.name}: memory: no GPU here, nothing offloaded")
        else:
            predicted = fit(layout, ctx, rt.n_batch, budget=1 << 62).bytes
            used = before - after
            print(f"{rt.name}: memory: {used / GiB:.2f} GiB used on the GPU (free before {before / GiB:.1f}), "
                  f"{predicted / GiB:.2f} GiB predicted (--ctx {ctx}, batch {rt.n_batch}): "
                  f"used/predicted {used / predicted:.2f}")
        t = curve(rt, rows)
        print(f"{rt.name}: t(1..{rows}) ms: " + " ".join(f"{x * 1e3:.2f}" for x in t))
        print(f"{rt.name}: t(n)/t(1): " + " ".join(f"{x / t[0]:.2f}" for x in t))
        sys.stdout.flush()
    finally:
        rt.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=33)
    args = ap.parse_args()
    try:
        import flylocal.llama.binding  # noqa: F401 - llama.cpp before numpy (flylocal/launch.py says why)

        for path in args.models:
            measure(path, args.ctx, args.rows)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
