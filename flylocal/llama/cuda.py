"""CUDA's runtime and cuBLAS where they came from PyPI (docs/operations.md, "Builds":
CUDA without a toolkit).

`scripts/setup.sh` builds llama.cpp's CUDA backend with NVIDIA's compiler wheels when a machine
has an NVIDIA GPU (or `--cuda ARCHS` asks) and no toolkit. The build's `libggml-cuda` then
needs `libcudart.so.13`, `libcublas.so.13` and `libcublasLt.so.13`, which live in the virtual
environment (`.venv/cuda/nvidia/cu13/lib`), where the dynamic loader does not look. They are
loaded here first, by path, before llama.cpp: the loader then finds each by its name among the
libraries already in the process. A machine with a toolkit, or a CPU build, loads nothing here.
"""

from __future__ import annotations

import ctypes
import re
import struct
import sys
from pathlib import Path

# The libraries in the order they need each other (cuBLAS needs cuBLASLt; both need the runtime).
ORDER = ("cudart", "cublasLt", "cublas")
_NEEDED = re.compile(r"lib(cudart|cublasLt|cublas)\.so\.(\d+)")
_loaded: list[Path] = []


def elf_needed(path: Path) -> list[str]:
    """The libraries a 64-bit little-endian ELF file names as needed (its DT_NEEDED entries),
    read from its dynamic section alone; [] for anything else."""
    with open(path, "rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            return []
        shoff, = struct.unpack_from("<Q", head, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", head, 0x3A)
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        sections = [struct.unpack_from("<IIQQQQIIQQ", table, i * shentsize) for i in range(len(table) // shentsize)]
        dynamic = next((s for s in sections if s[1] == 6), None)          # SHT_DYNAMIC
        if dynamic is None or dynamic[6] >= len(sections):
            return []
        f.seek(dynamic[4])
        entries = f.read(dynamic[5])
        strtab = sections[dynamic[6]]
        f.seek(strtab[4])
        strings = f.read(strtab[5])
    out = []
    for tag, value in struct.iter_unpack("<qQ", entries[: len(entries) // 16 * 16]):
        if tag == 0:                                                      # DT_NULL: the end
            break
        if tag == 1:                                                      # DT_NEEDED
            out.append(strings[value:strings.index(b"\0", value)].decode("utf-8", "replace"))
    return out


def needed(lib_dir: Path) -> dict[str, str]:
    """{name: soname} of the CUDA libraries the build in `lib_dir` links to (its libggml-cuda's
    DT_NEEDED entries); {} for a build without CUDA."""
    for lib in sorted(lib_dir.glob("libggml-cuda.so*")):
        try:
            names = elf_needed(lib)
        except (OSError, ValueError, struct.error):
            continue
        return {m.group(1): m.group(0) for m in map(_NEEDED.fullmatch, names) if m}
    return {}


def wheel_dirs(paths: list[str] | None = None) -> list[Path]:
    """The folders NVIDIA's wheels put libraries in: `nvidia/cu13/lib` (CUDA 13's wheels share
    it) and CUDA 12's one folder per package, under `<venv>/cuda` (where scripts/setup.sh
    installs them) and on the import path."""
    out = []
    for entry in [str(Path(sys.prefix) / "cuda"), *sys.path] if paths is None else paths:
        base = Path(entry or ".") / "nvidia"
        if not base.is_dir():
            continue
        out += sorted(p for p in base.glob("*/lib") if p.is_dir())
    return out


def preload(lib_dir: Path, paths: list[str] | None = None) -> list[Path]:
    """Load, by path, each CUDA library the build in `lib_dir` needs that a wheel holds; return
    the paths loaded. One the wheels do not hold is left to the system's loader (a toolkit)."""
    want = needed(lib_dir)
    if not want:
        return []
    dirs = wheel_dirs(paths)
    loaded = []
    for name in ORDER:
        soname = want.get(name)
        hit = next((d / soname for d in dirs if soname and (d / soname).is_file()), None)
        if hit is None or hit in _loaded:
            continue
        ctypes.CDLL(str(hit), mode=ctypes.RTLD_GLOBAL)
        _loaded.append(hit)
        loaded.append(hit)
    return loaded


def llama_lib_dir() -> Path | None:
    """Where llama-cpp-python will load llama.cpp from: LLAMA_CPP_LIB_PATH, else its package's
    lib folder (found without importing it)."""
    import importlib.util
    import os

    if os.environ.get("LLAMA_CPP_LIB_PATH"):
        return Path(os.environ["LLAMA_CPP_LIB_PATH"])
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "lib"
