"""Which llama.cpp build this process runs: fast or exact (docs/design.md, "Fast and exact").

- fast (the default): the llama.cpp library llama-cpp-python was installed with, with
  llama.cpp's own kernels for this machine (llamafile's sgemm, repacked CPU weights, a GPU).
  Strict output is the target's greedy output up to numerical near-ties.
- exact (`--exact`): a second CPU build of the same llama.cpp source with batch-invariant
  kernels (`GGML_LLAMAFILE=OFF`, `GGML_CPU_REPACK=OFF`), which `scripts/setup.sh` puts in
  `<venv>/flylocal-exact/lib`. Strict output then equals plain greedy output bit for bit
  (for Q4_0, Q4_1, Q8_0 and F16 weights; K-quants are not batch-invariant in any build).

llama-cpp-python loads its library once, at import, from `LLAMA_CPP_LIB_PATH` when that is
set, so the choice is made before `flylocal.llama.binding` is first imported, and holds for the
life of the process. `FLYLOCAL_EXACT=1` in the environment makes exact the default.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from flylocal.errors import FlylocalError

FAST, EXACT = "fast", "exact"
_chosen: str | None = None      # set by choose(), or from the environment at first use
_loaded: str | None = None      # the build llama_cpp was imported with


def exact_lib_dir() -> Path:
    """Where the batch-invariant build's libraries are: $FLYLOCAL_EXACT_LIB, else the one
    scripts/setup.sh made beside the virtual environment."""
    override = os.environ.get("FLYLOCAL_EXACT_LIB")
    return Path(override) if override else Path(sys.prefix) / "flylocal-exact" / "lib"


def exact_stamp() -> str | None:
    """The flags the exact build was made with, as recorded by scripts/setup.sh."""
    stamp = exact_lib_dir().parent / "build.txt"
    try:
        return stamp.read_text().strip()
    except OSError:
        return None


def fast_stamp() -> str | None:
    try:
        return (Path(sys.prefix) / "flylocal-build.txt").read_text().strip()
    except OSError:
        return None


def mode() -> str:
    """The build this process uses (or will use when llama.cpp is first loaded)."""
    if _loaded is not None:
        return _loaded
    if _chosen is not None:
        return _chosen
    return EXACT if os.environ.get("FLYLOCAL_EXACT", "").strip() not in ("", "0") else FAST


def choose(exact: bool) -> None:
    """Pick the build for this process. After llama.cpp is loaded only the same build can be
    picked again."""
    global _chosen
    wanted = EXACT if exact else FAST
    if _loaded is not None and _loaded != wanted:
        raise FlylocalError(f"this process already runs the {_loaded} build of llama.cpp; "
                            f"the {wanted} build needs a new process")
    _chosen = wanted


def activate() -> str:
    """Point llama-cpp-python at the chosen build. Called once, by flylocal.llama.binding, right
    before it imports llama_cpp."""
    global _loaded
    chosen = mode()
    if chosen == EXACT:
        lib = exact_lib_dir()
        if not any(lib.glob("libllama.*")) and not any(lib.glob("llama.*")):
            raise FlylocalError(f"--exact needs the batch-invariant llama.cpp build, and {lib} has none; "
                                "run scripts/setup.sh (or set FLYLOCAL_EXACT_LIB)")
        os.environ["LLAMA_CPP_LIB_PATH"] = str(lib)
    elif "LLAMA_CPP_LIB_PATH" in os.environ and os.environ["LLAMA_CPP_LIB_PATH"] == str(exact_lib_dir()):
        del os.environ["LLAMA_CPP_LIB_PATH"]      # inherited from an exact parent process
    # llama-cpp-python reads LLAMA_CPP_LIB_PATH once, when llama_cpp is first imported: an
    # earlier `import llama_cpp` has already loaded some build, whatever was chosen here.
    early = sys.modules.get("llama_cpp.llama_cpp")
    if early is not None:
        name = getattr(getattr(early, "_lib", None), "_name", None) or ""
        found = EXACT if Path(name).resolve().parent == exact_lib_dir().resolve() else FAST
        if found != chosen:
            raise FlylocalError(f"llama_cpp was imported before flylocal.llama.binding and loaded the {found} "
                                f"build ({name}); the {chosen} build needs flylocal.llama.binding imported first")
    _loaded = chosen
    return chosen


def loaded() -> str | None:
    return _loaded
