"""llama-cpp-python's binding, loaded once for the build this process chose (fast or exact,
flylocal.llama.kernels), and what every other module of the edge needs around it:

- llama.cpp's log goes to a small ring instead of stderr (flylocal keeps its stderr for its own
  one-line messages); a load error quotes the ring's last reason (`last_error`);
- Ctrl-C is held back across llama.cpp calls that call into Python (`interrupts_deferred`);
- ggml functions llama-cpp-python does not wrap, looked up in the loaded library (`ggml`).

Importing it loads llama.cpp: nothing else in flylocal imports llama_cpp.
"""

from __future__ import annotations

import _signal
import ctypes
import os
import re
import signal
import threading

from flylocal.errors import FlylocalError
from flylocal.llama import cuda, kernels

KERNELS = kernels.activate()     # fast or exact: which llama.cpp library is loaded just below
try:
    _lib_dir = cuda.llama_lib_dir()
    CUDA_LOADED = cuda.preload(_lib_dir) if _lib_dir is not None else []   # CUDA's libraries from PyPI, if the build needs them
except OSError as _e:
    raise FlylocalError(f"cannot load CUDA's libraries for the {KERNELS} llama.cpp build: {str(_e).strip()}; "
                        "run scripts/setup.sh again") from None

try:
    import llama_cpp  # noqa: E402 - after the build is chosen
except ImportError as _e:
    raise FlylocalError(f"llama-cpp-python is not installed here ({_e}); run scripts/setup.sh") from None
except (OSError, RuntimeError) as _e:
    _where = os.environ.get("LLAMA_CPP_LIB_PATH") or "llama-cpp-python's own"
    raise FlylocalError(f"cannot load the {KERNELS} llama.cpp build ({_where}): "
                        f"{str(_e).strip().splitlines()[-1] if str(_e).strip() else type(_e).__name__}; "
                        "run scripts/setup.sh again") from None


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


def interrupts_deferred() -> _Deferral:
    return _deferral


_LOG_LOCK = threading.Lock()
_LOG_TAIL: list[str] = []
_VERBOSE = bool(os.environ.get("FLYLOCAL_VERBOSE"))


@llama_cpp.llama_log_callback
def log_callback(level, text, user_data):  # noqa: ARG001 - ctypes signature
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


def take_log() -> None:
    """Point llama.cpp's log at the ring (again: llama-cpp-python's Llama sets its own)."""
    llama_cpp.llama_log_set(log_callback, ctypes.c_void_p(0))


take_log()
llama_cpp.llama_backend_init()


def clear_log() -> None:
    with _LOG_LOCK:
        _LOG_TAIL.clear()


# Most telling first: llama.cpp logs the reason ("... data is not within the file bounds, model
# is corrupted or incomplete"), then a bare "failed to load model" from the caller.
_REASONS = ("error loading model", "not within", "corrupt", "error", "invalid", "failed")


def last_error() -> str:
    """The reason llama.cpp logged for its last failure, without function-name prefixes."""
    with _LOG_LOCK:
        lines = [line.strip() for line in "".join(_LOG_TAIL).splitlines() if line.strip()]
    for word in _REASONS:
        for line in reversed(lines):
            if word in line:
                return re.sub(r"^(?:\w+: )*(?:error loading model: )?", "", line) or line
    return lines[-1] if lines else "llama.cpp gave no reason"


_GGML: dict = {}


def ggml(name: str, restype, *argtypes):
    """A ggml function of the loaded library (which links ggml, and its RPC backend in a build
    made with -DGGML_RPC=ON), so it is always the build this process chose."""
    if name not in _GGML:
        fn = getattr(llama_cpp.llama_cpp._lib, name)
        fn.restype, fn.argtypes = restype, list(argtypes)
        _GGML[name] = fn
    return _GGML[name]


# llama_get_logits with the buffer's address as an int: llama-cpp-python's own binding returns a
# float pointer, and a cast of it costs more than the call. A function object of its own (the
# library's item, not its attribute), so llama-cpp-python's binding keeps its return type.
logits_address = llama_cpp.llama_cpp._lib["llama_get_logits"]
logits_address.argtypes, logits_address.restype = [ctypes.c_void_p], ctypes.c_void_p
