"""`--gpu-layers auto`: which layers of the target and the draft go on the GPU (docs/operations.md,
"GPU offload").

On a build with a GPU backend, a model goes on the GPU whole when it fits in what the devices
have free: its layers' weights (from the GGUF header), its KV cache for `--ctx`, its output
layer and its compute buffers, within HEADROOM of the free memory. The target is placed first,
the draft in what is left. Where a model does not fit whole, as many of its layers go as fit,
the last ones first (llama.cpp offloads layers from the end), each with its share of the KV
cache; a draft only goes once the whole target has. On a CPU build nothing is offloaded.

llama.cpp counts the output layer as one layer more than the model's blocks: `n_layer + 1`
offloads everything.
"""

from __future__ import annotations

from dataclasses import dataclass

from flylocal.llama import memory
from flylocal.gguf_info import Layout

GiB = float(1 << 30)
ALL = 999               # n_gpu_layers for every layer, the output layer included (what -1 means)
NO_GPU = "none: this llama.cpp build has no GPU"


@dataclass(frozen=True)
class Fit:
    layers: int         # n_gpu_layers to give llama.cpp: 0, a count of blocks, or ALL
    blocks: int         # of the model's n_layer blocks, how many are on the GPU
    bytes: int          # GPU memory they take


@dataclass(frozen=True)
class Placement:
    target: int         # n_gpu_layers for each model
    draft: int
    reason: str         # what auto chose and why, for doctor
    line: str | None    # said when not everything fits


def shape(layout: Layout) -> memory.Shape:
    """What of the model at `layout` decides its context's size: what the loaded model's
    `Model.shape` reads, read from its header."""
    return memory.Shape(n_layer=layout.n_layer, n_head=layout.n_head, n_head_kv=layout.n_head_kv,
                        key_width=layout.key_width, value_width=layout.value_width, n_vocab=layout.n_vocab,
                        model_bytes=layout.model_bytes)


def fit(layout: Layout, n_ctx: int, n_batch: int, budget: int, flash: bool = True) -> Fit:
    """The most of `layout` that fits in `budget` bytes of GPU memory."""
    need = memory.need(shape(layout), n_ctx, n_batch, flash)
    kv_layer = need.kv // max(layout.n_layer, 1)
    whole = sum(layout.layer_bytes) + layout.output_bytes + need.kv + need.compute
    if whole <= budget:
        return Fit(ALL, layout.n_layer, whole)
    room, used, blocks = budget - need.compute, 0, 0
    for weights in reversed(layout.layer_bytes):
        if used + weights + kv_layer > room:
            break
        used += weights + kv_layer
        blocks += 1
    return Fit(blocks, blocks, used + need.compute if blocks else 0)


def place(target: Layout, draft: Layout | None, n_ctx: int, n_batch: int, free: int | None,
          names: tuple[str, str | None] = ("the target", "the draft"), device: str = "the GPU") -> Placement:
    """Where `auto` puts each model's layers, given the GPUs' free bytes (None: no GPU)."""
    if free is None:
        return Placement(0, 0, NO_GPU, None)
    budget = int(memory.HEADROOM * free)
    t = fit(target, n_ctx, n_batch, budget)
    d = fit(draft, n_ctx, n_batch, budget - t.bytes) if draft is not None and t.layers == ALL else None
    free_text = f"{free / GiB:.1f} GiB free"
    t_name, d_name = names
    if t.layers == ALL and (draft is None or d.layers == ALL):
        both = f"{t_name}" + (f" and {d_name}" if draft is not None else "")
        used = t.bytes + (d.bytes if d is not None else 0)
        return Placement(ALL, ALL if draft is not None else 0,
                         f"all: every layer of {both} on {device} ({used / GiB:.1f} of {free_text})", None)
    if t.layers == ALL:
        what = (f"every layer of {t_name} and {d.blocks} of {draft.n_layer} layers of {d_name} on {device} "
                f"({free_text}); the rest of {d_name} on the CPU")
        return Placement(ALL, d.layers, f"partial: {what}", f"--gpu-layers auto: {what}")
    what = (f"{t.blocks} of {target.n_layer} layers of {t_name} on {device} ({free_text}); the rest"
            + (f" and {d_name}" if draft is not None else "") + " on the CPU")
    return Placement(t.layers, 0, f"partial: {what}", f"--gpu-layers auto: {what}")
