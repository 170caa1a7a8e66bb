"""ggml's devices, through the loaded llama.cpp library: this machine's GPUs and CPU, the
devices of llama.cpp rpc servers (docs/scale-out.md), ggml's rpc server itself, and what this
build is (`build_info`)."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from flylocal.errors import FlylocalError
from flylocal.llama.binding import KERNELS, ggml, llama_cpp

DEVICE_CPU, DEVICE_GPU, DEVICE_IGPU = 0, 1, 2


@dataclass(frozen=True)
class Device:
    """A ggml device: its handle, name, description and memory (bytes)."""

    handle: int
    name: str
    description: str
    free: int
    total: int


def _device(handle: int) -> Device:
    name = ggml("ggml_backend_dev_name", ctypes.c_char_p, ctypes.c_void_p)(handle) or b""
    desc = ggml("ggml_backend_dev_description", ctypes.c_char_p, ctypes.c_void_p)(handle) or b""
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    ggml("ggml_backend_dev_memory", None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
         ctypes.POINTER(ctypes.c_size_t))(handle, ctypes.byref(free), ctypes.byref(total))
    return Device(handle, name.decode("utf-8", "replace"), desc.decode("utf-8", "replace"), free.value, total.value)


def gpu_offload() -> bool:
    """Whether this llama.cpp build has a local GPU backend (HIP, CUDA, Metal, ...). Not
    llama_supports_gpu_offload(), which also says yes for a CPU build with the RPC backend."""
    by_type = ggml("ggml_backend_dev_by_type", ctypes.c_void_p, ctypes.c_int)
    return bool(by_type(DEVICE_GPU) or by_type(DEVICE_IGPU))


def local_devices() -> list[Device]:
    """This machine's GPUs, or its CPU where it has none (what `flylocal rpc-server` serves)."""
    n = ggml("ggml_backend_dev_count", ctypes.c_size_t)()
    get = ggml("ggml_backend_dev_get", ctypes.c_void_p, ctypes.c_size_t)
    kind = ggml("ggml_backend_dev_type", ctypes.c_int, ctypes.c_void_p)
    handles = [get(i) for i in range(n)]
    gpus = [h for h in handles if kind(h) in (DEVICE_GPU, DEVICE_IGPU)]
    return [_device(h) for h in (gpus or [h for h in handles if kind(h) == DEVICE_CPU][:1])]


def cpu_buffer_type() -> int:
    """The CPU's buffer type: where tensors kept in this process's memory live."""
    cpu = ggml("ggml_backend_dev_by_type", ctypes.c_void_p, ctypes.c_int)(DEVICE_CPU)
    return ggml("ggml_backend_dev_buffer_type", ctypes.c_void_p, ctypes.c_void_p)(cpu)


def _rpc_reg() -> int:
    reg = ggml("ggml_backend_reg_by_name", ctypes.c_void_p, ctypes.c_char_p)(b"RPC")
    if not reg:
        raise FlylocalError("this llama.cpp build has no RPC backend; run scripts/setup.sh again "
                            "(it builds with -DGGML_RPC=ON)")
    return reg


def _rpc_proc(name: str, prototype):
    address = ggml("ggml_backend_reg_get_proc_address", ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_char_p)(_rpc_reg(), name.encode())
    if not address:
        raise FlylocalError(f"this llama.cpp build's RPC backend has no {name}")
    return prototype(address)


def rpc_devices(endpoints) -> list[Device]:
    """The devices the rpc servers at `endpoints` ("HOST:PORT") serve, in order, for this
    process's models (not registered for llama.cpp's automatic placement). ggml aborts the
    process when a server cannot be reached: call this in a worker (flylocal.llama.remote), after
    checking each server answers (flylocal.llama.rpc.hello)."""
    add_server = _rpc_proc("ggml_backend_rpc_add_server", ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p))
    count = ggml("ggml_backend_reg_dev_count", ctypes.c_size_t, ctypes.c_void_p)
    get = ggml("ggml_backend_reg_dev_get", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    devices = []
    for endpoint in endpoints:
        reg = add_server(endpoint.encode())
        if not reg:
            raise FlylocalError(f"the rpc server {endpoint} has no devices")
        devices += [_device(get(reg, i)) for i in range(count(reg))]
    return devices


def serve_rpc(endpoint: str, cache_dir: str | None, threads: int, devices: list[Device]) -> None:
    """ggml's rpc server for `devices` at `endpoint`: serves one client at a time, forever."""
    start = _rpc_proc("ggml_backend_rpc_start_server",
                      ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                                       ctypes.POINTER(ctypes.c_void_p)))
    handles = (ctypes.c_void_p * len(devices))(*[d.handle for d in devices])
    start(endpoint.encode(), os.fsencode(cache_dir) if cache_dir else None, threads, len(devices), handles)


def system_info() -> str:
    return llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()


def build_info() -> dict:
    """What this llama-cpp-python build is: version, backend and CPU flags."""
    return {
        "llama_cpp_python": llama_cpp.__version__,
        "kernels": KERNELS,
        "gpu_offload": gpu_offload(),
        "system_info": system_info(),
    }
