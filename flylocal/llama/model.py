"""A GGUF model loaded into llama.cpp: its weights (here, or on rpc servers), its metadata, and
the memory a context of it would take; and llama.cpp's quantizer, which derives models."""

from __future__ import annotations

import ctypes
import os
from dataclasses import replace
from pathlib import Path

from flylocal.errors import FlylocalError, ModelError
from flylocal.llama import memory
from flylocal.llama import kernels, placement
from flylocal.llama.binding import KERNELS, clear_log, interrupts_deferred, last_error, llama_cpp
from flylocal.llama.config import RuntimeConfig
from flylocal.llama.devices import Device, cpu_buffer_type, gpu_offload, local_devices, rpc_devices
from flylocal.host import usable_cores
from flylocal.gguf_info import check_gguf_file, read_layout


class _Override(ctypes.Structure):
    """llama_model_tensor_buft_override: tensors whose name matches `pattern` go to `buft`."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


class Model:
    """The model of `path` (or its vocabulary alone), with its layers on the rpc servers of
    `config`. `handle` is llama.cpp's; None once freed."""

    def __init__(self, path: str | os.PathLike, config: RuntimeConfig, vocab_only: bool = False):
        self.path = Path(path)
        self.name = self.path.name
        self.config = config
        self.devices: list[Device] = []       # the remote devices holding its layers
        check_gguf_file(self.path)

        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = config.n_gpu_layers
        mparams.vocab_only = vocab_only
        if config.rpc and not vocab_only:
            self.devices = rpc_devices(config.rpc)
            if len(config.tensor_split) > len(self.devices):
                raise FlylocalError(f"--tensor-split gives {len(config.tensor_split)} proportions for the "
                                    f"{len(self.devices)} devices of {', '.join(config.rpc)}")
            # A NULL-terminated device array, and the split, kept alive with the model.
            self._device_array = (ctypes.c_void_p * (len(self.devices) + 1))(*[d.handle for d in self.devices], None)
            mparams.devices = ctypes.addressof(self._device_array)
            mparams.n_gpu_layers = config.n_gpu_layers or 999     # every layer on the servers
            if config.tensor_split:
                self._split = (ctypes.c_float * llama_cpp.llama_max_devices())(*config.tensor_split)
                mparams.tensor_split = self._split
            if config.rpc_output == "here":
                # The output layer's weights in this process's memory: llama.cpp then computes
                # the logits here, and a verified row brings back its hidden state (n_embd
                # floats) instead of n_vocab logits (docs/scale-out.md). A tied output matrix is
                # the token embedding, which stays here anyway.
                self._overrides = (_Override * 2)(_Override(rb"^(output|token_embd)\.weight$", cpu_buffer_type()),
                                                  _Override(None, None))
                mparams.tensor_buft_overrides = ctypes.addressof(self._overrides)
        clear_log()
        with interrupts_deferred():
            self.handle = llama_cpp.llama_model_load_from_file(os.fsencode(self.path), mparams)
        if not self.handle:
            raise ModelError(f"cannot load {self.path}: {last_error()}")
        self.n_ctx_train = int(llama_cpp.llama_model_n_ctx_train(self.handle))

    def free(self) -> None:
        if self.handle:
            handle, self.handle = self.handle, None
            llama_cpp.llama_model_free(handle)

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_model_meta_val_str(self.handle, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def description(self) -> str:
        buf = ctypes.create_string_buffer(128)
        llama_cpp.llama_model_desc(self.handle, buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def chat_template(self) -> str | None:
        raw = llama_cpp.llama_model_chat_template(self.handle, None)
        return raw.decode("utf-8", "replace") if raw else None

    def shape(self, n_vocab: int) -> memory.Shape:
        handle = self.handle
        n_head = max(llama_cpp.llama_model_n_head(handle), 1)
        arch = self.meta("general.architecture") or ""
        default = llama_cpp.llama_model_n_embd(handle) // n_head

        def width(key):
            value = self.meta(f"{arch}.attention.{key}")
            return int(value) if value and value.isdigit() else default

        return memory.Shape(n_layer=llama_cpp.llama_model_n_layer(handle), n_head=n_head,
                            n_head_kv=llama_cpp.llama_model_n_head_kv(handle), key_width=width("key_length"),
                            value_width=width("value_length"), n_vocab=n_vocab,
                            model_bytes=int(llama_cpp.llama_model_size(handle)))

    def check_memory(self, flash: bool, n_vocab: int, slots: int = 1) -> None:
        """Refuse, in one line, a context this machine has no memory for (flylocal.llama.memory),
        before llama.cpp allocates it; the model is freed then."""
        problem = self.memory_problem(flash, n_vocab, slots)
        if problem:
            self.free()
            raise FlylocalError(problem)

    def memory_problem(self, flash: bool, n_vocab: int, slots: int = 1) -> str | None:
        """The one line saying why `slots` contexts of --ctx cells do not fit here, or None."""
        return memory_problem(self.shape(n_vocab), self.config, flash, self.name, slots)


def gpu_share(shape: memory.Shape, config: RuntimeConfig) -> tuple[float, int | None]:
    """(the share of a model of `shape` that `config` offloads to this machine's GPUs, their free
    bytes); (0, None) where nothing is offloaded."""
    if config.n_gpu_layers and gpu_offload():
        gpus = [d for d in local_devices() if d.name != "CPU"]
        if gpus:
            return min(config.n_gpu_layers, shape.n_layer) / max(shape.n_layer, 1), sum(d.free for d in gpus)
    return 0.0, None


def with_cells(shape: memory.Shape, config: RuntimeConfig) -> memory.Shape:
    """`shape` with the KV cache's cell sizes that `config` asks for (--cache-type-k/v)."""
    return replace(shape, key_bytes=memory.CELL_BYTES[config.type_k], value_bytes=memory.CELL_BYTES[config.type_v])


def memory_problem(shape: memory.Shape, config: RuntimeConfig, flash: bool, name: str, slots: int = 1) -> str | None:
    """The one line saying why `slots` contexts of `config`'s --ctx cells do not fit for a
    model of `shape`, with `config`'s layers offloaded, or None (flylocal.llama.memory)."""
    shape = with_cells(shape, config)
    share, free = gpu_share(shape, config)
    return memory.check(shape, config.n_ctx, config.n_batch, flash, name, gpu_share=share, gpu_free=free,
                        slots=slots)


def footprint(model: Model, config: RuntimeConfig, flash: bool, n_vocab: int, slots: int = 1) -> tuple[int, int]:
    """(bytes `model` holds with its context of `slots` sequences, the part of them on a GPU), as
    the memory check counts them (flylocal.llama.memory.held): what /api/ps reports."""
    shape = with_cells(model.shape(n_vocab), config)
    return memory.held(shape, config.n_ctx, config.n_batch, flash, gpu_share(shape, config)[0], slots)


def quantize(src: Path, dst: Path, qtype: str, threads: int = 0) -> None:
    """Write `src` requantized to `qtype` (for example Q4_0, Q8_0) at `dst` with llama.cpp's quantizer."""
    name = "ALL_F32" if qtype.upper() == "F32" else f"MOSTLY_{qtype.upper()}"   # F32 is all of it, not most
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{name}", None)
    if ftype is None:
        raise FlylocalError(f"unknown quantization type {qtype}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = threads or usable_cores()
    with interrupts_deferred():
        rc = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(dst), ctypes.byref(params))
    if rc != 0:
        raise FlylocalError(f"quantizing {src.name} to {qtype} failed: {last_error()}")


def flash_attn_type(mode: str, remote: bool = False) -> int:
    """auto: off in the exact build (batch invariance), and on rpc servers, whose device types
    the protocol does not tell; llama.cpp's own choice otherwise."""
    if mode == "on":
        return llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    if mode == "off" or remote or KERNELS == kernels.EXACT:
        return llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    return llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO


def sequences_that_fit(path, config: RuntimeConfig, most: int) -> int:
    """`--parallel auto`, as the loader resolves it (flylocal.loader): the most sequences of
    `config.n_ctx` cells each, up to `most`, that this machine has memory for (Model.check_memory's
    rule, on the shape the model's header gives, before it loads); 1 when no more fit. On rpc
    servers, `most`: their memory is theirs to judge."""
    if most <= 1:
        return 1
    if config.rpc:
        return most
    flash = flash_attn_type(config.flash_attn) != llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    shape = placement.shape(read_layout(Path(path)))
    return next((n for n in range(most, 1, -1) if not memory_problem(shape, config, flash, Path(path).name, n)), 1)
