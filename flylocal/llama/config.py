"""A loaded model's llama.cpp settings. Importing it loads nothing."""

from __future__ import annotations

from dataclasses import dataclass

from flylocal.errors import FlylocalError

# The KV cache's cell types a context takes (--cache-type-k / --cache-type-v): llama.cpp's ggml
# type ids by name (their sizes: flylocal.llama.memory.CELL_BYTES).
CACHE_TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q5_1": 7, "q5_0": 6, "q4_1": 3, "q4_0": 2, "iq4_nl": 20}
FLOAT_TYPES = ("f32", "f16", "bf16")


@dataclass(frozen=True)
class RuntimeConfig:
    n_ctx: int = 4096
    n_batch: int = 512
    n_threads: int | None = None   # None: auto (flylocal.llama.threads); 0: all cores; N: N threads
    n_gpu_layers: int = 0
    n_seq: int = 1                 # sequences, each with up to n_ctx cells (a server's --parallel slots;
                                   # --parallel auto is resolved by the loader, flylocal.loader)
    # Several sequences in one cache: False, a stream of cells per sequence (bit-exact beside
    # others in the exact build; uneven decodes run as several computations); True, llama.cpp's
    # unified KV cache (one computation per decode; every row attends over every sequence's cells).
    kv_unified: bool = False
    # The model's layers on these llama.cpp rpc servers ("HOST:PORT"), split by `tensor_split`
    # (proportions per remote device; empty: llama.cpp's split by free memory). Such a model
    # runs in a worker process (flylocal.llama.remote), since ggml aborts its process when a server
    # goes away; `rpc_timeout` bounds how long one call may wait for them (docs/scale-out.md).
    rpc: tuple[str, ...] = ()
    tensor_split: tuple[float, ...] = ()
    rpc_timeout: float = 60.0
    rpc_output: str = "here"       # where the output layer of a placed model runs: here or server
    # "auto": off in the exact build, where llama.cpp's CPU flash-attention kernel would give a
    # position other logits in a batch than alone once the cache passes 256 cells (measured:
    # |delta| up to 1.0), which breaks strict == greedy; llama.cpp's own choice elsewhere (on a
    # CPU it turns it on: prefill 13% and Spec-Bench through the server 3-8% faster here).
    flash_attn: str = "auto"
    # The KV cache's cell types (llama.cpp's names: f16, q8_0, q4_0, ...): a quantized cache holds
    # more context, and a prompt cache's entries shrink with it (flylocal.llama.context.CACHE_TYPES).
    type_k: str = "f16"
    type_v: str = "f16"


def cell_types(config: RuntimeConfig, flash: bool, exact: bool) -> tuple[int, int]:
    """The KV cache's (key, value) ggml types for --cache-type-k/v; FlylocalError for a quantized
    value cache without flash attention, which llama.cpp refuses (`exact`: the exact build, whose
    `auto` turns flash attention off)."""
    if config.type_v not in FLOAT_TYPES and not flash:
        raise FlylocalError(f"--cache-type-v {config.type_v} needs flash attention, which "
                            + ("exact mode turns off" if exact and config.flash_attn == "auto"
                               else "--flash-attn off turns off") + ": use --cache-type-v f16")
    return CACHE_TYPES[config.type_k], CACHE_TYPES[config.type_v]
