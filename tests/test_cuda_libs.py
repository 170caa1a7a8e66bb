"""flylocal.llama.cuda: a CUDA build of llama.cpp made with CUDA's wheels from PyPI needs their
runtime and cuBLAS, which the dynamic loader does not look for in a virtual environment; they are
loaded by path, before llama.cpp, from the wheels' folder on the import path. Real shared
libraries stand in for NVIDIA's here (compiled on the spot, named as theirs are): nothing of
CUDA's is needed to check which are found, in which order, and that a CPU build loads none."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from flylocal.llama import cuda

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler")


def shared_lib(path: Path, body: str = "int stand_in(void) { return 7; }") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    src = path.parent / f"{path.name}.c"
    src.write_text(body)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(path), f"-Wl,-soname,{path.name}", str(src)], check=True)
    return path


def cuda_build(folder: Path, needs: tuple[str, ...]) -> Path:
    """A llama.cpp build folder whose libggml-cuda is linked to libraries with the sonames
    `needs` (stand-ins built beside it): its DT_NEEDED entries name them, as a real one's do."""
    stubs = folder.parent / "link-stubs"
    for name in needs:
        shared_lib(stubs / name)
    (folder / "x.c").parent.mkdir(parents=True, exist_ok=True)
    (folder / "x.c").write_text("int ggml_cuda_stand_in(void) { return 1; }")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(folder / "libggml-cuda.so.0"), str(folder / "x.c"),
                    "-Wl,--no-as-needed", f"-L{stubs}", *(f"-l:{n}" for n in needs)], check=True)
    (folder / "libggml-cuda.so").symlink_to("libggml-cuda.so.0")
    return folder


def test_the_needed_libraries_are_read_off_the_dynamic_section(tmp_path):
    build = cuda_build(tmp_path / "build", ("libcudart.so.13", "libcublas.so.13"))
    assert cuda.elf_needed(build / "libggml-cuda.so")[:2] == ["libcudart.so.13", "libcublas.so.13"]
    # a string that merely reads like a soname is not a need
    shared_lib(tmp_path / "other" / "libggml-cuda.so", 'const char *s = "libcudart.so.13";')
    assert cuda.needed(tmp_path / "other") == {}
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "libggml-cuda.so").write_text("not a library")
    assert cuda.needed(tmp_path / "text") == {}


def test_a_cpu_build_needs_and_loads_nothing(tmp_path):
    shared_lib(tmp_path / "build" / "libllama.so")
    assert cuda.needed(tmp_path / "build") == {}
    assert cuda.preload(tmp_path / "build", [str(tmp_path)]) == []


def test_a_cuda_13_build_loads_the_wheels_runtime_then_cublaslt_then_cublas(tmp_path):
    build = cuda_build(tmp_path / "build", ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13"))
    assert cuda.needed(build) == {"cudart": "libcudart.so.13", "cublas": "libcublas.so.13",
                                  "cublasLt": "libcublasLt.so.13"}
    site = tmp_path / "site"
    wheel = site / "nvidia" / "cu13" / "lib"         # CUDA 13's wheels share one folder
    for name, value in (("cudart", 13), ("cublasLt", 14), ("cublas", 15)):
        shared_lib(wheel / f"lib{name}.so.13", f"int {name}_probe(void) {{ return {value}; }}")
    shared_lib(site / "nvidia" / "cu13" / "lib" / "libcudart.so.12")         # another major: not taken
    loaded = cuda.preload(build, [str(tmp_path / "elsewhere"), str(site)])
    assert [p.name for p in loaded] == ["libcudart.so.13", "libcublasLt.so.13", "libcublas.so.13"]
    assert all(p.parent == wheel for p in loaded)
    # loaded globally: their symbols are the process's now, as llama.cpp's loader will find them
    assert ctypes.CDLL(None).cublas_probe() == 15
    assert cuda.preload(build, [str(site)]) == []                     # once per process


def test_cuda_12_wheels_one_folder_a_package_and_a_toolkit_left_to_the_system(tmp_path):
    build = cuda_build(tmp_path / "build", ("libcudart.so.12", "libcublas.so.12"))
    site = tmp_path / "site"
    shared_lib(site / "nvidia" / "cuda_runtime" / "lib" / "libcudart.so.12", "int rt12(void) { return 1; }")
    loaded = cuda.preload(build, [str(site)])      # cuBLAS is not among the wheels: the system's loader finds it or not
    assert [p.name for p in loaded] == ["libcudart.so.12"]
    assert cuda.wheel_dirs([str(site), str(tmp_path / "none")]) == [site / "nvidia" / "cuda_runtime" / "lib"]


def test_the_venvs_own_cuda_folder_is_searched_first(tmp_path, monkeypatch):
    """scripts/setup.sh puts the wheels in <venv>/cuda, which is not on the import path."""
    monkeypatch.setattr(cuda.sys, "prefix", str(tmp_path / "venv"))
    lib = shared_lib(tmp_path / "venv" / "cuda" / "nvidia" / "cu13" / "lib" / "libcudart.so.13")
    assert cuda.wheel_dirs()[0] == lib.parent
