"""scripts/device_check.sh without a GPU: --prepare packs a build (real shared libraries stand in
for llama.cpp's CUDA build, compiled on the spot), the trimmed source and the packages the
device lacks, and --dry-run lists them with their sizes and refuses a call over 64 MiB or a
build that does not link CUDA 13; each step run before the one it needs says so in one line;
and --cpu measures, step after step in order, on real llama.cpp with models written on the spot.
Nothing is fetched: an sdist and wheels at hand stand in for the package index."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "device_check.sh"
VERSION = "0.3.36"
LIBS = ("libggml-base", "libggml", "libggml-cpu", "libggml-cuda", "libggml-rpc", "libllama", "libllama-common",
        "libllama-server-impl", "libmtmd")
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler")


def fake_sdist(folder: Path) -> Path:
    """A llama-cpp-python sdist with the layout --prepare trims: one small file in each part."""
    top = folder / f"llama_cpp_python-{VERSION}"
    src = top / "vendor" / "llama.cpp"
    kept = ["CMakeLists.txt", "LICENSE", "cmake/common.cmake", "common/common.cpp", "include/llama.h", "src/llama.cpp",
            "tools/CMakeLists.txt", "tools/server/server.cpp", "tools/mtmd/mtmd.cpp", "vendor/CMakeLists.txt",
            "vendor/cpp-httplib/httplib.h", "ggml/CMakeLists.txt", "ggml/cmake/ggml.cmake", "ggml/include/ggml.h",
            "ggml/src/ggml.c", *(f"ggml/src/{d}/x.c" for d in ("ggml-cpu", "ggml-cuda", "ggml-rpc"))]
    for name in [*kept, "ggml/src/ggml-vulkan/left-out.c", "docs/left-out.md", "models/left-out.gguf"]:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(f"// {name}\n")
    out = folder / f"llama_cpp_python-{VERSION}.tar.gz"
    with tarfile.open(out, "w:gz") as tar:
        tar.add(top, arcname=top.name)
    return out


def fake_build(folder: Path, cuda_needs=("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13")) -> Path:
    """A build folder as --prepare's own build leaves it: build/bin with versioned libraries
    (libggml-cuda naming the CUDA libraries it links) and llama-server."""
    bin_ = folder / "build" / "bin"
    bin_.mkdir(parents=True)
    for lib in LIBS:
        names = ", ".join(f'"{n}"' for n in cuda_needs) if lib == "libggml-cuda" else '"x"'
        (bin_ / f"{lib}.c").write_text(f"const char *needed[] = {{{names}}};\n")
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(bin_ / f"{lib}.so.0.1.2"), str(bin_ / f"{lib}.c")], check=True)
        (bin_ / f"{lib}.so.0").symlink_to(f"{lib}.so.0.1.2")
        (bin_ / f"{lib}.so").symlink_to(f"{lib}.so.0")
    (bin_ / "main.c").write_text("int main(void) { return 0; }\n")
    subprocess.run(["gcc", "-o", str(bin_ / "llama-server"), str(bin_ / "main.c")], check=True)
    return folder


def fake_wheels(folder: Path) -> Path:
    """The serve packages as wheels, pydantic_core's with its library for Python 3.12."""
    folder.mkdir()
    for package in ("fastapi", "starlette", "uvicorn", "pydantic", "pydantic_core", "annotated_types"):
        with zipfile.ZipFile(folder / f"{package}-1.0-py3-none-any.whl", "w") as whl:
            whl.writestr(f"{package}/__init__.py", "")
            whl.writestr(f"{package}-1.0.dist-info/METADATA", "Name: x\n")
            if package == "pydantic_core":
                whl.writestr("pydantic_core/_pydantic_core.cpython-312-x86_64-linux-gnu.so", b"\x7fELF")
    return folder


def script(*args, env=None, timeout=300):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def prepared(tmp_path: Path, **build) -> tuple[subprocess.CompletedProcess, dict]:
    env = {"FLYLOCAL_DEVICE_DIR": str(tmp_path / "dev"), "FLYLOCAL_DEVICE_SDIST": str(fake_sdist(tmp_path)),
           "FLYLOCAL_DEVICE_BUILD": str(fake_build(tmp_path / "built", **build)),
           "FLYLOCAL_DEVICE_WHEELS": str(fake_wheels(tmp_path / "wheels"))}
    return script("--prepare", env=env), env


@needs_gcc
def test_prepare_packs_what_travels_and_the_dry_run_lists_it_within_64_mib(tmp_path):
    done, env = prepared(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "unbound variable" not in done.stderr
    dev = tmp_path / "dev"
    with tarfile.open(dev / "build.tar.xz") as tar:
        names = {n.removeprefix("./") for n in tar.getnames()}
    for lib in LIBS:
        assert {f"{lib}.so.0", f"{lib}.so"} <= names, lib            # the libraries by their sonames, linked
    assert "llama-server" in names
    with tarfile.open(dev / "llama.cpp.tar.xz") as tar:
        source = set(tar.getnames())
    assert {"./tools/server/server.cpp", "./common/common.cpp", "./ggml/src/ggml-cuda/x.c"} <= source
    assert not any("left-out" in n for n in source)                   # trimmed to this build's parts
    site = dev / "site"
    assert (site / "click").is_dir() and (site / "llama_cpp").is_dir() and not (site / "llama_cpp" / "lib").exists()
    assert (site / "pydantic_core" / "_pydantic_core.cpython-312-x86_64-linux-gnu.so").is_file()
    assert not list(site.glob("*.dist-info"))
    listed = done.stdout
    for part in ("build.tar.xz", "llama.cpp.tar.xz", "site", "the working tree"):
        assert part in listed
    assert "libggml-cuda needs: libcublas.so.13 libcublasLt.so.13 libcudart.so.13" in listed
    assert "one call carries" in listed and "MiB of 64" in listed
    again = script("--dry-run", env=env)                              # the same check alone, later
    assert again.returncode == 0 and again.stdout == listed, again.stderr


@needs_gcc
def test_the_dry_run_refuses_a_call_over_64_mib(tmp_path):
    done, env = prepared(tmp_path)
    assert done.returncode == 0, done.stderr
    (tmp_path / "dev" / "site" / "weights.bin").write_bytes(os.urandom(65 << 20))
    over = script("--dry-run", env=env)
    assert over.returncode == 1 and "over the 64 MiB a call carries" in over.stderr.strip().splitlines()[-1]


@needs_gcc
def test_a_build_that_does_not_link_cuda_13_is_refused(tmp_path):
    done, _ = prepared(tmp_path, cuda_needs=("libcudart.so.12", "libcublas.so.12"))
    assert done.returncode == 1 and "does not link CUDA 13's runtime and cuBLAS" in done.stderr


def test_steps_out_of_order_say_which_comes_first(tmp_path):
    env = {"FLYLOCAL_DEVICE_DIR": str(tmp_path / "nothing")}
    for step, first in (("--dry-run", "--prepare first"), ("", "--prepare first"),
                        ("--measure", "scripts/device_check.sh first")):
        done = script(*([step] if step else []), env=env)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1 and first in lines[0], (step, done.stderr)


def test_an_unknown_step_prints_the_usage():
    done = script("--bogus")
    assert done.returncode == 2 and "--prepare" in done.stdout and "--dry-run" in done.stdout
    assert "set -euo" not in done.stdout


@pytest.mark.slow
def test_the_cpu_run_measures_each_step_in_order(tmp_path):
    env = {"FLYLOCAL_DEVICE_DIR": str(tmp_path / "dev"), "FLYLOCAL_DEVICE_QUICK": "1", "LLAMA_SERVER": ""}
    done = script("--cpu", env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    headings = [line for line in out.splitlines() if line.startswith("## ")]
    assert [h.split(":")[0].split(",")[0] for h in headings] == [
        "## models", "## build", "## memory and t(1..33)", "## Spec-Bench through servers"], headings
    assert "smollm2.gguf: t(1..3) ms:" in out and "target.gguf: memory: no GPU here" in out
    for mode in ("autoregressive", "strict-pld", "fly-pld", "strict-mla", "fly-mla"):
        assert f"| {mode} |" in out, mode
    assert "llama-server's modes are skipped" in done.stderr
    assert out.rstrip().endswith("s)")                               # the last step's seconds
    assert not (tmp_path / "dev" / "lib").exists()                    # --cpu runs this machine's own build


def test_the_budget_skips_what_would_not_fit_and_the_output_comes_back_in_a_file(tmp_path):
    """With no time left every timed step is cut short or skipped, each saying so in a line, and
    the run still ends 0; where $OUT is set, all it printed is in $OUT/device_check.txt."""
    out = tmp_path / "out"
    out.mkdir()
    env = {"FLYLOCAL_DEVICE_DIR": str(tmp_path / "dev"), "FLYLOCAL_DEVICE_QUICK": "1", "LLAMA_SERVER": "",
           "FLYLOCAL_DEVICE_BUDGET": "0", "OUT": str(out)}
    done = script("--cpu", env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:]
    text = (out / "device_check.txt").read_text()
    assert "## models" in text and "## Spec-Bench through servers" in text
    assert "no time left for the servers' run at 0.8" in text and "Traceback" not in text
