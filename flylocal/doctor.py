"""`flylocal doctor`: what this build is, and whether a model is batch-invariant in it.

Strict verification equals plain greedy decoding token for token only when the target gives
the same logits for a position whether it is decoded alone or inside a batch (docs/design.md, "Batch invariance"). This
is measured, not assumed: the same tokens are teacher-forced one at a time and then as one
batch, and the logits compared.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from flylocal import models
from flylocal.adaptive import timed_decode
from flylocal.runtime import Runtime, RuntimeConfig, build_info

PROBE_TEXT = (
    "The committee met on Tuesday to review the budget. After a long discussion, the members "
    "agreed to postpone the vote until the next meeting, when the final figures would be ready."
)
PROBE_ROWS = 16


def build_report() -> list[str]:
    info = build_info()
    stamp = Path(sys.prefix) / "flylocal-build.txt"
    flags = stamp.read_text().strip() if stamp.exists() else "unknown (not built by scripts/setup.sh)"
    system = info["system_info"]
    lines = [
        f"llama-cpp-python {info['llama_cpp_python']}",
        f"backend: {'GPU offload available' if info['gpu_offload'] else 'CPU only'}",
        f"system: {system}",
        f"build flags: {flags}",
    ]
    hints = []
    if "LLAMAFILE=1" in system.replace(" ", ""):
        hints.append("llamafile kernels are on: batched logits may differ from single-token logits")
    if "REPACK=1" in system.replace(" ", ""):
        hints.append("CPU weight repacking is on: batched logits may differ from single-token logits")
    lines += [f"note: {h}" for h in hints]
    return lines


def batch_invariance(rt: Runtime, rows: int = PROBE_ROWS, contexts=(24, 320)) -> tuple[float, int, int]:
    """(max |delta logit|, argmax flips, rows compared) between decoding `rows` tokens one at a
    time and as one batch, after a short and after a long context (past 256 cache cells, where
    llama.cpp's attention kernels change blocking)."""
    ids = rt.tokenize(PROBE_TEXT * 12)
    worst, flips, compared = 0.0, 0, 0
    for n_prefix in contexts:
        if n_prefix + rows > min(len(ids), rt.n_ctx):
            continue
        prefix, probe = ids[:n_prefix], ids[n_prefix : n_prefix + rows]
        rt.reset()
        rt.decode(prefix)
        single = np.stack([rt.decode(probe[i : i + 1], logits_from=0)[0].copy() for i in range(rows)])  # [rows, V]
        rt.truncate(n_prefix)
        batched = rt.decode(probe, logits_from=0).copy()                                               # [rows, V]
        worst = max(worst, float(np.abs(single - batched).max()))
        flips += int((single.argmax(axis=1) != batched.argmax(axis=1)).sum())
        compared += rows
    rt.reset()
    return worst, flips, compared


def decode_costs(rt: Runtime, sizes=(1, 2, 3, 5, 9, 17), context: int = 256, tries: int = 5) -> dict[int, float]:
    """Best-of-`tries` seconds of one decode of n rows (all with logits) after `context` tokens:
    what a round's verification costs on this machine, relative to a single step."""
    ids = rt.tokenize(PROBE_TEXT * 12)[:context]
    rt.reset()
    rt.decode(ids[:-1])
    best = {n: min(timed_decode(rt, int(ids[-1]), n) for _ in range(tries)) for n in sizes}
    rt.reset()
    return best


def model_report(spec: str, threads: int = 0, flash_attn: str = "auto") -> list[str]:
    path = models.resolve(spec)
    with Runtime(path, RuntimeConfig(n_ctx=1024, n_threads=threads, flash_attn=flash_attn)) as rt:
        delta, flips, rows = batch_invariance(rt)
        costs = decode_costs(rt)
        lines = [f"model: {path} ({rt.description()}, vocab {rt.n_vocab}), flash attention {flash_attn}"
                 f"{' (off in a CPU build)' if flash_attn == 'auto' and not build_info()['gpu_offload'] else ''}"]
    if delta == 0.0:
        lines.append(f"batch-invariant: yes ({rows} positions, single vs batched logits bitwise equal); "
                     "strict output equals plain greedy output token for token")
    else:
        lines.append(f"batch-invariant: no (max |delta logit| {delta:.4g}, argmax flips {flips}/{rows}); "
                     "strict output can leave plain greedy output at numerical near-ties")
    one = costs[1]
    lines.append("decode cost by rows (ms, in single steps): "
                 + ", ".join(f"{n}: {1000 * t:.1f} ({t / one:.1f})" for n, t in costs.items()))
    return lines
