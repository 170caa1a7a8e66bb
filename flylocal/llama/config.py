"""A loaded model's llama.cpp settings. Importing it loads nothing."""

from __future__ import annotations

from dataclasses import dataclass


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
