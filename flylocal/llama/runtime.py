"""One GGUF model and its context, driven through llama-cpp-python's low-level API.

This is the only module that imports llama_cpp. It owns:
- loading (with one-line errors for missing, non-GGUF and truncated files);
- tokenize / detokenize, with special tokens and multibyte-safe streaming;
- `decode(tokens, logits_from)`: one batched decode that asks llama.cpp for logits only on
  the rows from `logits_from` on, returned as a zero-copy numpy view;
- `truncate(n_keep)`: the one way to roll the KV cache back (llama_memory_seq_rm, checked,
  with a re-evaluating fallback where partial removal is refused);
- `reuse_prefix(tokens)`: keeps the longest cached prefix of a token sequence, which gives
  drafters their catch-up and chat its prompt reuse.

The runtime keeps the token ids that are in its KV cache (`tokens`), so the cache can always
be rebuilt and compared.
"""

from __future__ import annotations

import _signal
import contextlib
import ctypes
import hashlib
import math
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flylocal.decoding.contracts import reusable_prefix
from flylocal.decoding.costs import CostCurve
from flylocal.errors import FlylocalError, ModelError
from flylocal.llama import kernels, memory
from flylocal.llama.threads import ThreadControl, candidates, keep_count, known_count, usable_cores
from flylocal.models.files import check_gguf_file

KERNELS = kernels.activate()     # fast or exact: which llama.cpp library is loaded just below

try:
    import llama_cpp  # noqa: E402 - after the build is chosen
except ImportError as _e:
    raise FlylocalError(f"llama-cpp-python is not installed here ({_e}); run scripts/setup.sh") from None
except (OSError, RuntimeError) as _e:
    _where = os.environ.get("LLAMA_CPP_LIB_PATH") or "llama-cpp-python's own"
    raise FlylocalError(f"cannot load the {KERNELS} llama.cpp build ({_where}): "
                        f"{str(_e).strip().splitlines()[-1] if str(_e).strip() else type(_e).__name__}; "
                        "run scripts/setup.sh again") from None

# llama.cpp logs to stderr by default. flylocal keeps its stderr for its own one-line
# messages, so llama.cpp's log goes to a small ring; load errors quote its last error.
_LOG_LOCK = threading.Lock()


class _Deferral:
    """Hold Ctrl-C back until the block ends, then raise KeyboardInterrupt: for llama.cpp calls
    that call back into Python (its log, which a decode or a change of thread count writes to).
    A KeyboardInterrupt raised inside a ctypes callback is printed as a traceback and dropped,
    and the interrupt would be lost.

    Cheap enough for every decode: in the main thread, while Ctrl-C has Python's default
    handler, one that raises KeyboardInterrupt just as the default does is put in its place,
    except that inside a deferred block or inside the log callback it only notes the interrupt,
    which is raised when the block ends (or, after a callback outside any block, when the next
    block begins). Elsewhere (another thread, or Ctrl-C handled or ignored by someone else) a
    block defers nothing."""

    def __init__(self):
        self.depth = 0          # deferred blocks open in the main thread
        self.in_callback = 0    # the log callback running in the main thread
        self.pending = False

    def _handler(self, signum, frame):  # noqa: ARG002 - signal handler signature
        if self.depth or self.in_callback:
            self.pending = True
            return
        raise KeyboardInterrupt

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            handler = _signal.getsignal(signal.SIGINT)   # without signal's enum lookup, which raises inside
            if handler is signal.default_int_handler:
                signal.signal(signal.SIGINT, self._handler)
            elif handler != self._handler:
                return self     # someone else's: nothing deferred, nothing counted
            if self.pending and not self.depth:
                self.pending = False
                raise KeyboardInterrupt     # noted inside a callback outside any block
            self.depth += 1
        return self

    def __exit__(self, *exc):
        if self.depth and threading.current_thread() is threading.main_thread():
            self.depth -= 1
            if not self.depth and self.pending:
                self.pending = False
                if exc[0] is None:
                    raise KeyboardInterrupt
        return False


_deferral = _Deferral()
_LOG_TAIL: list[str] = []
_VERBOSE = bool(os.environ.get("FLYLOCAL_VERBOSE"))


@llama_cpp.llama_log_callback
def _log_callback(level, text, user_data):  # noqa: ARG001 - ctypes signature
    main = threading.current_thread() is threading.main_thread()
    if main:
        _deferral.in_callback += 1           # a Ctrl-C landing here is noted, not dropped
    try:
        message = text.decode("utf-8", "replace") if text else ""
        if _VERBOSE:
            os.write(2, message.encode())
        with _LOG_LOCK:
            _LOG_TAIL.append(message)
            del _LOG_TAIL[:-64]
    finally:
        if main:
            _deferral.in_callback -= 1


llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
llama_cpp.llama_backend_init()


def _clear_log() -> None:
    with _LOG_LOCK:
        _LOG_TAIL.clear()


# Most telling first: llama.cpp logs the reason ("... data is not within the file bounds, model
# is corrupted or incomplete"), then a bare "failed to load model" from the caller.
_REASONS = ("error loading model", "not within", "corrupt", "error", "invalid", "failed")


def _last_log_error() -> str:
    """The reason llama.cpp logged for its last failure, without function-name prefixes."""
    with _LOG_LOCK:
        lines = [line.strip() for line in "".join(_LOG_TAIL).splitlines() if line.strip()]
    for word in _REASONS:
        for line in reversed(lines):
            if word in line:
                return re.sub(r"^(?:\w+: )*(?:error loading model: )?", "", line) or line
    return lines[-1] if lines else "llama.cpp gave no reason"


# llama_get_logits with the buffer's address as an int: llama-cpp-python's own binding returns a
# float pointer, and a cast of it costs more than the call.
_logits_address = llama_cpp.llama_cpp._lib["llama_get_logits"]
_logits_address.argtypes, _logits_address.restype = [ctypes.c_void_p], ctypes.c_void_p


def interrupts_deferred() -> _Deferral:
    return _deferral


@dataclass(frozen=True)
class RuntimeConfig:
    n_ctx: int = 4096
    n_batch: int = 512
    n_threads: int | None = None   # None: auto (flylocal.llama.threads); 0: all cores; N: N threads
    n_gpu_layers: int = 0
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


def _flash_attn_type(mode: str, remote: bool = False) -> int:
    """auto: off in the exact build (batch invariance), and on rpc servers, whose device types
    the protocol does not tell; llama.cpp's own choice otherwise."""
    if mode == "on":
        return llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    if mode == "off" or remote or KERNELS == kernels.EXACT:
        return llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    return llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO


# ggml's device API, reached through the loaded libllama (which links ggml, and its RPC
# backend in a build made with -DGGML_RPC=ON), so it is always the build this process chose.
_GGML: dict = {}
DEVICE_CPU, DEVICE_GPU, DEVICE_IGPU = 0, 1, 2


def _ggml(name: str, restype, *argtypes):
    if name not in _GGML:
        fn = getattr(llama_cpp.llama_cpp._lib, name)
        fn.restype, fn.argtypes = restype, list(argtypes)
        _GGML[name] = fn
    return _GGML[name]


def gpu_offload() -> bool:
    """Whether this llama.cpp build has a local GPU backend (HIP, CUDA, Metal, ...). Not
    llama_supports_gpu_offload(), which also says yes for a CPU build with the RPC backend."""
    by_type = _ggml("ggml_backend_dev_by_type", ctypes.c_void_p, ctypes.c_int)
    return bool(by_type(DEVICE_GPU) or by_type(DEVICE_IGPU))


@dataclass(frozen=True)
class Device:
    """A ggml device: its handle, name, description and memory (bytes)."""

    handle: int
    name: str
    description: str
    free: int
    total: int


def _device(handle: int) -> Device:
    name = _ggml("ggml_backend_dev_name", ctypes.c_char_p, ctypes.c_void_p)(handle) or b""
    desc = _ggml("ggml_backend_dev_description", ctypes.c_char_p, ctypes.c_void_p)(handle) or b""
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    _ggml("ggml_backend_dev_memory", None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
          ctypes.POINTER(ctypes.c_size_t))(handle, ctypes.byref(free), ctypes.byref(total))
    return Device(handle, name.decode("utf-8", "replace"), desc.decode("utf-8", "replace"), free.value, total.value)


def _rpc_reg() -> int:
    reg = _ggml("ggml_backend_reg_by_name", ctypes.c_void_p, ctypes.c_char_p)(b"RPC")
    if not reg:
        raise FlylocalError("this llama.cpp build has no RPC backend; run scripts/setup.sh again "
                            "(it builds with -DGGML_RPC=ON)")
    return reg


def _rpc_proc(name: str, prototype):
    address = _ggml("ggml_backend_reg_get_proc_address", ctypes.c_void_p, ctypes.c_void_p,
                    ctypes.c_char_p)(_rpc_reg(), name.encode())
    if not address:
        raise FlylocalError(f"this llama.cpp build's RPC backend has no {name}")
    return prototype(address)


class _Override(ctypes.Structure):
    """llama_model_tensor_buft_override: tensors whose name matches `pattern` go to `buft`."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def rpc_devices(endpoints) -> list[Device]:
    """The devices the rpc servers at `endpoints` ("HOST:PORT") serve, in order, for this
    process's models (not registered for llama.cpp's automatic placement). ggml aborts the
    process when a server cannot be reached: call this in a worker (flylocal.llama.remote), after
    checking each server answers (flylocal.llama.rpc.hello)."""
    add_server = _rpc_proc("ggml_backend_rpc_add_server", ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p))
    count = _ggml("ggml_backend_reg_dev_count", ctypes.c_size_t, ctypes.c_void_p)
    get = _ggml("ggml_backend_reg_dev_get", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    devices = []
    for endpoint in endpoints:
        reg = add_server(endpoint.encode())
        if not reg:
            raise FlylocalError(f"the rpc server {endpoint} has no devices")
        devices += [_device(get(reg, i)) for i in range(count(reg))]
    return devices


def local_devices() -> list[Device]:
    """What `flylocal rpc-server` serves: this machine's GPUs, or its CPU where it has none."""
    n = _ggml("ggml_backend_dev_count", ctypes.c_size_t)()
    get = _ggml("ggml_backend_dev_get", ctypes.c_void_p, ctypes.c_size_t)
    kind = _ggml("ggml_backend_dev_type", ctypes.c_int, ctypes.c_void_p)
    handles = [get(i) for i in range(n)]
    gpus = [h for h in handles if kind(h) in (DEVICE_GPU, DEVICE_IGPU)]
    return [_device(h) for h in (gpus or [h for h in handles if kind(h) == DEVICE_CPU][:1])]


def serve_rpc(endpoint: str, cache_dir: str | None, threads: int, devices: list[Device]) -> None:
    """ggml's rpc server for `devices` at `endpoint`: serves one client at a time, forever."""
    start = _rpc_proc("ggml_backend_rpc_start_server",
                      ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                                       ctypes.POINTER(ctypes.c_void_p)))
    handles = (ctypes.c_void_p * len(devices))(*[d.handle for d in devices])
    start(endpoint.encode(), os.fsencode(cache_dir) if cache_dir else None, threads, len(devices), handles)


def default_threads() -> int:
    return usable_cores()


CONTROL_ROWS = 32     # decodes up to this many rows steer --threads auto (a round, a draft step)


class Runtime:
    """A loaded model with one context (sequence 0) and its KV bookkeeping."""

    def __init__(self, path: str | os.PathLike, config: RuntimeConfig = RuntimeConfig()):
        self._load_model(path, config)
        self._create_context()
        self._init_state()

    def _load_model(self, path, config: RuntimeConfig, vocab_only: bool = False) -> None:
        """The model (or its vocabulary alone), with its layers on the rpc servers of `config`."""
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
                cpu = _ggml("ggml_backend_dev_by_type", ctypes.c_void_p, ctypes.c_int)(DEVICE_CPU)
                buft = _ggml("ggml_backend_dev_buffer_type", ctypes.c_void_p, ctypes.c_void_p)(cpu)
                self._overrides = (_Override * 2)(_Override(rb"^(output|token_embd)\.weight$", buft),
                                                  _Override(None, None))
                mparams.tensor_buft_overrides = ctypes.addressof(self._overrides)
        _clear_log()
        with interrupts_deferred():
            self._model = llama_cpp.llama_model_load_from_file(os.fsencode(self.path), mparams)
        if not self._model:
            raise ModelError(f"cannot load {self.path}: {_last_log_error()}")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.n_ctx_train = int(llama_cpp.llama_model_n_ctx_train(self._model))

    def _meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def _shape(self) -> memory.Shape:
        model = self._model
        n_head = max(llama_cpp.llama_model_n_head(model), 1)
        arch = self._meta("general.architecture") or ""
        default = llama_cpp.llama_model_n_embd(model) // n_head

        def width(key):
            value = self._meta(f"{arch}.attention.{key}")
            return int(value) if value and value.isdigit() else default

        return memory.Shape(n_layer=llama_cpp.llama_model_n_layer(model), n_head=n_head,
                            n_head_kv=llama_cpp.llama_model_n_head_kv(model), key_width=width("key_length"),
                            value_width=width("value_length"), n_vocab=self.n_vocab,
                            model_bytes=int(llama_cpp.llama_model_size(model)))

    def _check_memory(self, flash: bool) -> None:
        """Refuse, in one line, a context this machine has no memory for (flylocal.llama.memory),
        before llama.cpp allocates it."""
        shape = self._shape()
        share, free = 0.0, None
        if self.config.n_gpu_layers and gpu_offload():
            gpus = [d for d in local_devices() if d.name != "CPU"]
            if gpus:
                share = min(self.config.n_gpu_layers, shape.n_layer) / max(shape.n_layer, 1)
                free = sum(d.free for d in gpus)
        problem = memory.check(shape, self.config.n_ctx, self.config.n_batch, flash, self.name, gpu_share=share,
                               gpu_free=free)
        if problem:
            llama_cpp.llama_model_free(self._model)
            self._model = None
            raise FlylocalError(problem)

    def _create_context(self) -> None:
        config = self.config
        threads = config.n_threads or default_threads()
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = config.n_ctx
        cparams.n_batch = config.n_batch
        cparams.n_ubatch = config.n_batch
        cparams.n_seq_max = 1
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        # A full-size sliding-window cache keeps every position, so rolling back a draft
        # never needs a position the window already evicted (Gemma 3).
        cparams.swa_full = True
        cparams.no_perf = True
        cparams.flash_attn_type = _flash_attn_type(config.flash_attn, remote=bool(config.rpc))
        if not config.rpc:                  # the servers' memory is theirs to judge
            self._check_memory(cparams.flash_attn_type != llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        with interrupts_deferred():
            self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            self._model = None
            raise ModelError(f"cannot create a context for {self.path}: {_last_log_error()}")
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        # llama.cpp may round the context up (padding); the user's size is the limit.
        self.n_ctx = min(config.n_ctx, llama_cpp.llama_n_ctx(self._ctx))
        self.n_batch = llama_cpp.llama_n_batch(self._ctx)
        self.n_threads = threads

        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        n = self.n_batch
        self._b_token = np.ctypeslib.as_array(self._batch.token, shape=(n,))     # [n_batch] int32
        self._b_pos = np.ctypeslib.as_array(self._batch.pos, shape=(n,))         # [n_batch] int32
        self._b_logits = np.ctypeslib.as_array(self._batch.logits, shape=(n,))   # [n_batch] int8
        np.ctypeslib.as_array(self._batch.n_seq_id, shape=(n,))[:] = 1
        for i in range(n):
            self._batch.seq_id[i][0] = 0

    def _init_state(self, threads_auto: bool = True) -> None:
        """The bookkeeping of the cache, the thread control and the vocabulary tables."""
        config, threads = self.config, self.n_threads
        self._tokens = np.zeros(self.n_ctx, dtype=np.int32)  # [n_ctx] ids held in the KV cache
        # `n_past` never exceeds what the cache holds. Where an exception (Ctrl-C) can land
        # between a change to the cache and the record of it, `_unsynced` is set first, and
        # the next cache operation drops every cell past `n_past`.
        self.n_past = 0
        self._unsynced = False
        self._specials = None   # control-token texts, found lazily for chat templates
        self._view = (None, None)                   # (the logits buffer's address, a view of it)
        self._pieces: dict[int, bytes] = {}         # each token's text, as read once
        self._formatter = None  # the compiled chat template, made on first use
        # --threads auto: start on every core, then follow how fast decodes run (flylocal.llama.threads).
        # A process starts from the count the last one settled on, when that was recent, and
        # otherwise measures each count once before its first prompt (_probe_threads).
        self.thread_control = None
        self._probed = True    # --threads auto: each count measured before a first prompt, or no need
        if config.n_threads is None and threads_auto:
            counts = candidates(threads)
            known = known_count(counts)
            self.thread_control = ThreadControl(counts, known or threads, on_settle=keep_count)
            self._probed = known is not None or len(counts) < 2
        self._steady = 0       # > 0: thread count held (calibration measures one count)
        self.calibration_threads = threads
        # What a decode of n rows costs here, shared by everything that drafts for this model;
        # keyed for the disk cache by what it depends on (docs/design.md, "Cost model").
        self.costs = CostCurve(key=self.cost_key())
        self.costs.on_key = self.n_threads == self.calibration_threads
        self.bos = llama_cpp.llama_vocab_bos(self._vocab)
        self.eos = llama_cpp.llama_vocab_eos(self._vocab)
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        self.vocab_type = llama_cpp.llama_vocab_type(self._vocab)
        self._eog = np.zeros(self.n_vocab, dtype=bool)
        for t in range(self.n_vocab):
            if llama_cpp.llama_vocab_is_eog(self._vocab, t):
                self._eog[t] = True

    # ----- lifetime -----
    def cost_key(self) -> dict:
        st = self.path.stat()
        system = llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()
        return {
            "model": str(self.path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "kernels": KERNELS, "llama_cpp_python": llama_cpp.__version__,
            "build": kernels.exact_stamp() if KERNELS == kernels.EXACT else kernels.fast_stamp(),
            "system": hashlib.sha256(system.encode()).hexdigest()[:16],
            "gpu_layers": self.config.n_gpu_layers if gpu_offload() else 0,
            "flash_attn": int(_flash_attn_type(self.config.flash_attn, remote=bool(self.config.rpc))),
            "threads": self.calibration_threads, "batch": self.n_batch,
        } | ({"rpc": list(self.config.rpc), "tensor_split": list(self.config.tensor_split),
              "rpc_output": self.config.rpc_output} if self.config.rpc else {})

    def close(self) -> None:
        """Free the context and the model. Any later use raises instead of touching freed memory.
        A cost curve refined by the rounds run is then written to the disk cache."""
        if getattr(self, "_ctx", None):
            ctx, self._ctx = self._ctx, None
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(ctx)
        if getattr(self, "_model", None):
            model, self._model, self._vocab = self._model, None, None
            llama_cpp.llama_model_free(model)
        costs = getattr(self, "costs", None)
        if costs is not None and costs.dirty:      # after freeing: a Ctrl-C here leaks nothing
            costs.save()

    @property
    def closed(self) -> bool:
        return getattr(self, "_ctx", None) is None

    def _check_open(self) -> None:
        if self._ctx is None:
            raise FlylocalError(f"{self.name} was already closed")

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ----- metadata -----
    def chat_template(self) -> str | None:
        self._check_open()
        raw = llama_cpp.llama_model_chat_template(self._model, None)
        return raw.decode("utf-8", "replace") if raw else None

    def format_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str | None:
        """Render `messages` (and the functions in `tools`, for a template that reads them) with
        the model's GGUF chat template (Jinja2, as llama-cpp-python does), ending with the
        assistant's turn; None when the model has no template."""
        if self._formatter is None:          # compiling the template takes ~5 ms: once per model
            template = self.chat_template()
            if template is None:
                return None
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            self._formatter = Jinja2ChatFormatter(
                template=template,
                eos_token=self.piece(self.eos, special=True).decode("utf-8", "replace"),
                bos_token=self.piece(self.bos, special=True).decode("utf-8", "replace"),
                add_generation_prompt=True,
            )
        try:
            return self._formatter(messages=messages, tools=tools).prompt
        except Exception as e:  # a template may raise for unsupported roles or orderings
            raise FlylocalError(f"the chat template of {self.name} failed: {e}") from None

    def description(self) -> str:
        buf = ctypes.create_string_buffer(128)
        llama_cpp.llama_model_desc(self._model, buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def token_text(self, token: int) -> bytes:
        """The vocabulary's stored text for a token (as used by the compatibility rule)."""
        return llama_cpp.llama_vocab_get_text(self._vocab, token) or b""

    def is_control(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_control(self._vocab, token))

    def control_ids(self) -> dict[bytes, int]:
        """{text: id} of the tokens that are only ever written by templates, never typed."""
        return {text.encode(): spec[0] for text, spec in self._control_tokens()[1].items()}

    def is_eog(self, token: int) -> bool:
        return bool(self._eog[token]) if 0 <= token < self.n_vocab else False

    @property
    def eog_mask(self) -> np.ndarray:  # [n_vocab] bool
        return self._eog

    # ----- text -----
    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> np.ndarray:
        """Token ids of `text` (str, or UTF-8 bytes). Special-token text ("<|im_end|>") is plain
        text unless `parse_special`: text from a user never becomes control tokens by default."""
        self._check_open()
        try:
            data = text if isinstance(text, bytes) else text.encode("utf-8")
        except UnicodeEncodeError:
            raise FlylocalError("the text is not valid UTF-8") from None
        cap = len(data) + 16
        out = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), out, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            out = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), out, cap, add_special, parse_special)
        ids = np.ctypeslib.as_array(out)[:n].astype(np.int32)
        if len(ids) >= 2 and ids[0] == self.bos and ids[1] == self.bos:
            ids = ids[1:]  # a template that writes BOS itself, plus the tokenizer's own
        return ids

    def _control_tokens(self):
        """(regex matching any control-token text, longest first; {text: (id, lstrip, rstrip)}).
        These are the tokens llama.cpp parses out of text only when asked to parse specials."""
        if self._specials is None:
            wanted = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
            found = {}
            for t in range(self.n_vocab):
                attr = llama_cpp.llama_vocab_get_attr(self._vocab, t)
                if attr & wanted:
                    text = self.piece(t, special=True).decode("utf-8", "replace")
                    if text:
                        found.setdefault(text, (t, bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP),
                                                bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP)))
            texts = sorted(found, key=len, reverse=True)
            pattern = re.compile("|".join(map(re.escape, texts))) if texts else None
            self._specials = (pattern, found)
        return self._specials

    def tools_template(self) -> str | None:
        """The chat template, if it renders offered functions (it reads a `tools` variable)."""
        template = self.chat_template() or ""
        return template if re.search(r"\btools\b", template) else None

    def tokenize_chat(self, messages: list[dict], tools: list[dict] | None = None) -> np.ndarray | None:
        """Token ids of `messages` rendered with the model's chat template, ending with the
        assistant's turn; None when the model has no template.

        Only the template's own text may hold control tokens. Message contents are plain text:
        typed "<|im_end|>" stays characters, never the end-of-turn token. The rendering is
        located by rendering once more with a placeholder for each content; where the template
        only inserts (or trims) the contents, the result is the template's exact token
        sequence. Where it transforms them otherwise, the placeholders' layout is used.
        """
        rendered = self.format_chat(messages, tools)
        if rendered is None:
            return None
        marks = [f"\ue000flylocal-{i}\ue001" for i in range(len(messages))]
        skeleton = self.format_chat([{**m, "content": mark} for m, mark in zip(messages, marks)], tools)
        # [template, index, template, index, ..., template]: odd items are message indices
        split = re.split("\ue000flylocal-(\\d+)\ue001", skeleton)
        pieces = [int(x) if i % 2 else x for i, x in enumerate(split)]
        contents = [str(m.get("content") or "") for m in messages]
        for variant in (contents, [c.strip() for c in contents]):
            if "".join(variant[x] if i % 2 else x for i, x in enumerate(pieces)) == rendered:
                contents = variant
                break
        parts: list = []                                    # str (plain text) or int (control token)
        pattern, specials = self._control_tokens()
        for i, x in enumerate(pieces):
            if i % 2:
                parts.append(contents[x])
                continue
            pos = 0
            for match in pattern.finditer(x) if pattern else ():
                token, lstrip, rstrip = specials[match.group()]
                parts.append(x[pos : match.start()])
                if lstrip and parts and isinstance(parts[-1], str):
                    parts[-1] = parts[-1].rstrip()
                parts.append(token)
                pos = match.end()
                if rstrip:
                    while pos < len(x) and x[pos].isspace():
                        pos += 1
            parts.append(x[pos:])
        ids: list[int] = []
        text = ""
        for part in parts + [None]:
            if isinstance(part, str):
                text += part
                continue
            if text:
                ids.extend(self.tokenize(text, add_special=False, parse_special=False).tolist())
                text = ""
            if part is not None:
                ids.append(part)
        if self.add_bos and (not ids or ids[0] != self.bos):
            ids.insert(0, self.bos)
        return np.asarray(ids, dtype=np.int32)

    def piece(self, token: int, special: bool = False) -> bytes:
        if not special:                  # a token's text never changes: read once, the stream's per token
            text = self._pieces.get(token)
            if text is None:
                text = self._pieces[token] = self._read_piece(token, False)
            return text
        return self._read_piece(token, True)

    def _read_piece(self, token: int, special: bool) -> bytes:
        self._check_open()
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens, special: bool = False) -> str:
        return b"".join(self.piece(int(t), special) for t in tokens).decode("utf-8", "replace")

    # ----- KV cache -----
    @property
    def tokens(self) -> np.ndarray:  # [n_past] int32, a view
        return self._tokens[: self.n_past]

    def decode(self, tokens, logits_from: int | None = None) -> np.ndarray | None:
        """Append `tokens` to the cache. Return the logits of rows `logits_from:` as a
        zero-copy view `[n_rows, n_vocab] float32`, valid until the next decode.

        Only the requested rows ever reach the output buffer. The rows before `logits_from` go
        in chunks of n_batch without logits until the rest fits one decode, which holds them
        and the requested rows together: a prompt's tail and the first round cost one decode
        (docs/design.md, "The round"). `logits_from=None` asks for none.
        """
        self._check_open()
        self._sync()
        tokens, start, rows = self._decode_args(tokens, logits_from)
        n = len(tokens)
        steer = self.thread_control is not None and not self._steady and start == 0 and 0 < rows <= CONTROL_ROWS
        if start and self.thread_control is not None and not self._steady:
            if not self._probed:
                self._probe_threads(int(tokens[0]))
            self._use_threads(self.thread_control.home)     # a prompt never runs on a count on trial
        i = 0
        while i < start and (n - i > self.n_batch or start >= n):
            j = min(start, i + self.n_batch)
            self._decode_chunk(tokens[i:j], logits_from=j - i)
            i = j
        if start >= n:
            return None
        if not steer:
            self._decode_chunk(tokens[i:], logits_from=start - i)
        else:
            self._use_threads(self.thread_control.current)
            t0 = time.perf_counter()
            self._decode_chunk(tokens, logits_from=0)
            self._steer(rows, time.perf_counter() - t0)
        return self._logits(rows)

    def _logits(self, rows: int) -> np.ndarray:
        """The output buffer's first `rows` rows as a view [rows, n_vocab] float32. A view is made
        when the buffer moves or more rows are asked for than it covers, and sliced otherwise (a
        ctypes array type and a numpy array every decode cost a round tens of microseconds)."""
        address = _logits_address(self._ctx)
        at, view = self._view
        if at != address or len(view) < rows:
            pointer = ctypes.cast(address, ctypes.POINTER(ctypes.c_float))
            view = np.ctypeslib.as_array(pointer, shape=(rows, self.n_vocab))
            self._view = address, view
        return view[:rows]

    def _decode_args(self, tokens, logits_from: int | None) -> tuple[np.ndarray, int, int]:
        """(tokens as int32, the first row with logits, the rows with logits), checked."""
        tokens = np.asarray(tokens, dtype=np.int32)
        n = len(tokens)
        if self.n_past + n > self.n_ctx:
            raise FlylocalError(f"context full: {self.n_past} + {n} tokens exceed --ctx {self.n_ctx}")
        start = n if logits_from is None else logits_from
        if n - start > self.n_batch:
            raise ValueError(f"logits requested for {n - start} rows; at most n_batch={self.n_batch}")
        return tokens, start, n - start

    def _decode_chunk(self, chunk: np.ndarray, logits_from: int) -> None:
        """One llama_decode of `chunk` (at most n_batch tokens), with logits for rows `logits_from:`."""
        m = len(chunk)
        p0 = self.n_past
        self._b_token[:m] = chunk
        self._b_pos[:m] = np.arange(p0, p0 + m, dtype=np.int32)
        self._b_logits[:logits_from] = 0
        self._b_logits[logits_from:m] = 1
        self._batch.n_tokens = m
        self._tokens[p0 : p0 + m] = chunk      # past n_past: not yet claimed as cached
        self._unsynced = True                  # the cache may hold more than n_past from here ...
        with interrupts_deferred():            # llama.cpp logs from inside a decode now and then
            rc = llama_cpp.llama_decode(self._ctx, self._batch)
        if rc != 0:
            # llama.cpp keeps the cells it wrote for earlier ubatches; _sync drops them.
            self._sync()
            reason = {1: "no KV cache slot (context full)", 2: "aborted"}.get(rc, f"error {rc}")
            raise FlylocalError(f"llama_decode failed on {self.name}: {reason}")
        self.n_past = p0 + m
        self._unsynced = False                 # ... until here

    def _probe_threads(self, token: int, passes: int = 2) -> None:
        """--threads auto in a process that knows nothing yet: time a single-row decode at each
        candidate count (after one warm-up, `passes` times each, the least counting; rolled back)
        and start on the fastest, so that the first prompt already runs on it. Tens of
        milliseconds on an idle machine, against seconds a prompt on every core of a busy one
        can lose."""
        self._probed = True
        control, n_past = self.thread_control, self.n_past
        if n_past + 1 > self.n_ctx:
            return
        one = np.array([token], dtype=np.int32)
        best: dict[int, float] = {}
        try:
            for i in range(passes + 1):
                for count in control.counts if i else control.counts[-1:]:
                    self._use_threads(count)
                    t0 = time.perf_counter()
                    self._decode_chunk(one, logits_from=1)
                    seconds = time.perf_counter() - t0
                    self.truncate(n_past)
                    if i:                                  # the first decode is a warm-up
                        best[count] = min(best.get(count, math.inf), seconds)
        finally:
            self.truncate(n_past)
        control.seed(best)

    def _steer(self, rows: int, seconds: float) -> None:
        """--threads auto: feed the decode's time to the controller, relative to the cost
        curve's shape for `rows`, and take the thread count it chooses."""
        self._use_threads(self.thread_control.observe(seconds / self.costs.shape(rows) if rows > 1 else seconds,
                                                      seconds))

    def _use_threads(self, n: int) -> None:
        if n != self.n_threads:
            self.set_threads(n)

    def set_threads(self, n: int) -> None:
        """Decode on `n` CPU threads from the next decode on (llama_set_n_threads)."""
        self._check_open()
        with interrupts_deferred():          # llama.cpp logs the change
            llama_cpp.llama_set_n_threads(self._ctx, n, n)
        self.n_threads = n
        self.costs.on_key = n == self.calibration_threads     # rounds at another count refine, unsaved

    @contextlib.contextmanager
    def steady(self):
        """Hold the thread count at the one the cost curve is keyed by (a calibration)."""
        held = self.n_threads
        self._steady += 1
        try:
            if held != self.calibration_threads:
                self.set_threads(self.calibration_threads)
            yield
        finally:
            self._steady -= 1
            if not self._steady and self.n_threads != held and not self.closed:
                self.set_threads(held)

    def _sync(self) -> None:
        """Drop cache cells past `n_past` left by an operation an exception cut short."""
        if self._unsynced:
            self._check_open()
            if not self._seq_rm(self.n_past):
                self._rebuild(self.n_past)
            self._unsynced = False

    def truncate(self, n_keep: int) -> None:
        """Roll the cache back to its first `n_keep` tokens: the one way flylocal rolls back."""
        self._sync()
        if n_keep >= self.n_past:
            return
        if n_keep < 0:
            raise ValueError("n_keep must be >= 0")
        self._check_open()
        self._unsynced = True
        self.n_past = n_keep
        if not self._seq_rm(n_keep):
            # Partial removal refused (recurrent or otherwise unrollable memory): start the
            # sequence again and re-evaluate the kept tokens, so the state stays consistent.
            self._rebuild(n_keep)
        self._unsynced = False

    def _rebuild(self, n_keep: int) -> None:
        kept = self._tokens[:n_keep].copy()
        self.n_past = 0
        llama_cpp.llama_memory_clear(self._mem, True)
        self._unsynced = False
        self.decode(kept)

    def _seq_rm(self, n_keep: int) -> bool:
        return bool(llama_cpp.llama_memory_seq_rm(self._mem, 0, n_keep, -1))

    def reset(self) -> None:
        self._check_open()
        self.n_past = 0
        llama_cpp.llama_memory_clear(self._mem, True)
        self._unsynced = False

    def reuse_prefix(self, tokens: np.ndarray) -> int:
        """Keep the longest cached prefix of `tokens`, leaving at least the last token out of
        the cache, and return how many tokens were kept. tokens[kept:] still need decoding."""
        self._sync()
        keep = reusable_prefix(self._tokens[: self.n_past], tokens)
        self.truncate(keep)
        return keep


def quantize(src: Path, dst: Path, qtype: str, threads: int = 0) -> None:
    """Write `src` requantized to `qtype` (for example Q4_0, Q8_0) at `dst` with llama.cpp's quantizer."""
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype.upper()}", None)
    if ftype is None:
        raise FlylocalError(f"unknown quantization type {qtype}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = threads or default_threads()
    with interrupts_deferred():
        rc = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(dst), ctypes.byref(params))
    if rc != 0:
        raise FlylocalError(f"quantizing {src.name} to {qtype} failed: {_last_log_error()}")


def build_info() -> dict:
    """What this llama-cpp-python build is: version, backend and CPU flags."""
    system = llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()
    gpu = gpu_offload()
    return {
        "llama_cpp_python": llama_cpp.__version__,
        "kernels": KERNELS,
        "gpu_offload": gpu,
        "system_info": system,
    }


class LlamaCppPythonBaseline:
    """llama-cpp-python's own high-level generation, greedy, as a point of comparison: its
    `create_completion` on the prompt token ids flylocal rendered (so the format is the same),
    optionally with its own prompt-lookup drafter (which needs an n_ctx x n_vocab logits buffer).

    With a draft model, llama-cpp-python keeps logits for every position but sizes their buffer
    from the `logits_all` argument (n_batch rows unless it is True), so past n_batch tokens of
    prompt plus output its `eval` fails to broadcast into an empty slice; asking for
    `logits_all=True` gives the buffer the n_ctx rows it uses."""

    def __init__(self, path: Path, config: RuntimeConfig, prompt_lookup: bool = False):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        threads = config.n_threads or default_threads()
        self._llama = llama_cpp.Llama(
            model_path=str(path), n_ctx=config.n_ctx, n_batch=config.n_batch, n_threads=threads,
            n_threads_batch=threads, n_gpu_layers=config.n_gpu_layers, verbose=False,
            draft_model=LlamaPromptLookupDecoding(num_pred_tokens=4) if prompt_lookup else None,
            logits_all=prompt_lookup,
        )
        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))

    def generate(self, prompt_ids, max_tokens: int, sampling=None, reuse: bool = False) -> tuple[str, int, float, float]:
        """(text, completion tokens, wall seconds, decode seconds after the first token).
        With `reuse`, llama-cpp-python keeps the prefix its cache shares with the prompt (a
        later turn of a conversation), as flylocal does."""
        import time

        if not reuse:
            self._llama.reset()
        t0 = time.perf_counter()
        first = None
        pieces = []
        if sampling is None or sampling.temperature <= 0:
            options = dict(temperature=0.0, top_k=1)
        else:
            options = dict(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                           min_p=sampling.min_p, repeat_penalty=sampling.repeat_penalty, seed=sampling.seed)
        for chunk in self._llama.create_completion([int(t) for t in prompt_ids], max_tokens=max_tokens,
                                                   stream=True, **options):
            if first is None:
                first = time.perf_counter()
            pieces.append(chunk["choices"][0]["text"])
        end = time.perf_counter()
        text = "".join(pieces)
        n = len(self._llama.tokenize(text.encode("utf-8"), add_bos=False, special=False)) if text else 0
        return text, n, end - t0, end - (first or end)

    def close(self) -> None:
        self._llama.close()
