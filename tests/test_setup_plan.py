"""scripts/setup.sh --plan: which build setup chooses on a machine, told by the tools it asks.

Fake `rocminfo`, `hipconfig`, `nvidia-smi` and `nvcc` print what the real ones print on an
RX 7900 XTX, an MI300X and an RTX 4090; PATH holds them and the few tools the plan itself
runs, nothing else, so a real GPU tool on the machine running the tests is never seen. Nothing
is built or installed.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parent.parent / "scripts" / "setup.sh"
TOOLS = ("bash", "dirname", "grep", "sort", "paste", "tr", "uname", "cat", "sed", "cut")


def rocminfo(gpu: str, isa: str, marketing: str) -> str:
    """rocminfo's agents: the CPU first (no gfx name), then the GPU with its ISA."""
    return f"""ROCk module version 6.8.5 is loaded
=====================
HSA System Attributes
=====================
Runtime Version:         1.14
*******
Agent 1
*******
  Name:                    AMD Ryzen 9 7950X 16-Core Processor
  Marketing Name:          AMD Ryzen 9 7950X 16-Core Processor
  Device Type:             CPU
*******
Agent 2
*******
  Name:                    {gpu}
  Marketing Name:          {marketing}
  Device Type:             GPU
  ISA Info:
    ISA 1
      Name:                    amdgcn-amd-amdhsa--{isa}
"""


MACHINES = {
    "rx7900xtx": {"rocminfo": rocminfo("gfx1100", "gfx1100", "Radeon RX 7900 XTX"),
                  "hipconfig -l": "/opt/rocm-6.3.0/lib/llvm/bin", "hipconfig -R": "/opt/rocm-6.3.0"},
    "mi300x": {"rocminfo": rocminfo("gfx942", "gfx942:sramecc+:xnack-", "AMD Instinct MI300X"),
               "hipconfig -l": "/opt/rocm/lib/llvm/bin", "hipconfig -R": "/opt/rocm"},
    "rtx4090": {"nvidia-smi -L": "GPU 0: NVIDIA GeForce RTX 4090 (UUID: GPU-5d1c2b7e-9a0f-4c7e-8f59-2b1d3e4a6c70)",
                "nvidia-smi --query-gpu=compute_cap --format=csv,noheader": "8.9",
                "nvcc --version": "nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release 12.6, V12.6.85"},
}


def fake_path(tmp_path: Path, answers: dict[str, str]) -> str:
    """A PATH of the plan's own tools and fakes that print `answers` (by command line)."""
    base, fake = tmp_path / "base", tmp_path / "fake"
    base.mkdir()
    fake.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, tool
        (base / tool).symlink_to(found)
    by_tool: dict[str, dict[str, str]] = {}
    for line, out in answers.items():
        tool, _, rest = line.partition(" ")
        by_tool.setdefault(tool, {})[rest] = out
    for tool, outs in by_tool.items():
        cases = "".join(f"  '{rest}') cat <<'EOF'\n{out}\nEOF\n  ;;\n" for rest, out in outs.items())
        script = fake / tool
        script.write_text(f'#!{shutil.which("bash")}\ncase "$*" in\n{cases}  *) exit 1 ;;\nesac\n')
        script.chmod(0o755)
    return f"{fake}:{base}"


def run_plan(tmp_path: Path, answers: dict[str, str], *args: str, **env) -> subprocess.CompletedProcess:
    environ = {"PATH": fake_path(tmp_path, answers), "HOME": str(tmp_path), **env}
    return subprocess.run([shutil.which("bash"), str(SETUP), "--plan", *args], capture_output=True, text=True,
                          env=environ, timeout=60)


def plan(tmp_path: Path, answers: dict[str, str], *args: str, **env) -> list[str]:
    done = run_plan(tmp_path, answers, *args, **env)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def smi(cuda: str) -> str:
    """nvidia-smi's header, which names the newest CUDA its driver runs."""
    return f"| NVIDIA-SMI 580.95.05    Driver Version: 580.95.05    CUDA Version: {cuda}     |"


WHEELS = str(SETUP.parent.parent / ".venv" / "cuda" / "nvidia" / "cu13")


def test_an_rx_7900_xtx_gets_a_hip_build_for_gfx1100_with_rocms_compiler(tmp_path):
    fast, exact, _ = plan(tmp_path, MACHINES["rx7900xtx"])
    assert '"-DGGML_HIP=ON -DAMDGPU_TARGETS=gfx1100 -DGGML_RPC=ON -DLLAVA_BUILD=OFF"' in fast
    assert "HIPCXX=/opt/rocm-6.3.0/lib/llvm/bin/clang HIP_PATH=/opt/rocm-6.3.0" in fast
    assert exact.startswith("exact build: a CPU build of its own") and "HIP" not in exact


def test_an_mi300x_gets_gfx942_without_its_feature_suffixes(tmp_path):
    fast, exact, _ = plan(tmp_path, MACHINES["mi300x"])
    assert "-DGGML_HIP=ON -DAMDGPU_TARGETS=gfx942 " in fast and "sramecc" not in fast
    assert "HIP" not in exact and "-DGGML_LLAMAFILE=OFF -DGGML_CPU_REPACK=OFF" in exact


def test_an_rtx_4090_gets_a_cuda_build_for_its_architecture_only(tmp_path):
    fast, exact, _ = plan(tmp_path, MACHINES["rtx4090"])
    assert '"-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=89 -DGGML_RPC=ON -DLLAVA_BUILD=OFF"' in fast
    assert "HIPCXX" not in fast
    assert exact.startswith("exact build: a CPU build of its own") and "CUDA" not in exact


def test_a_gpu_without_a_toolkit_gets_cuda_13s_compiler_from_pypi(tmp_path):
    gpu = {k: v for k, v in MACHINES["rtx4090"].items() if not k.startswith("nvcc")} | {"nvidia-smi": smi("13.0")}
    fast, cuda, exact, _ = plan(tmp_path, gpu)
    assert fast.startswith('fast build: CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=89 -DGGML_RPC=ON')
    assert f"-DCUDAToolkit_ROOT={WHEELS} -DCMAKE_CUDA_COMPILER={WHEELS}/bin/nvcc -DGGML_CUDA_NO_VMM=ON" in fast
    assert f"-Wl,-rpath-link,{WHEELS}/lib" in fast
    assert cuda.startswith("cuda: no nvcc here: CUDA 13.0's compiler, runtime and cuBLAS from PyPI")
    assert exact.startswith("exact build: a CPU build of its own") and "CUDA" not in exact


def test_a_driver_too_old_for_cuda_13_is_told_what_to_install(tmp_path):
    gpu = {k: v for k, v in MACHINES["rtx4090"].items() if not k.startswith("nvcc")} | {"nvidia-smi": smi("12.4")}
    done = run_plan(tmp_path, gpu)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and not done.stdout
    assert "runs CUDA 12 at most" in lines[0] and "install CUDA's toolkit (nvcc), or a newer driver" in lines[0]


def test_cuda_asked_for_on_a_machine_without_a_gpu(tmp_path):
    fast, cuda, _, _ = plan(tmp_path, {}, "--cuda", "90")
    assert '"-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_RPC=ON -DLLAVA_BUILD=OFF' in fast and WHEELS in fast
    assert cuda.startswith("cuda: no nvcc here")
    # with a toolkit, it is the toolkit's compiler, as without --cuda
    (tmp_path / "t").mkdir()
    fast, exact, _ = plan(tmp_path / "t", {"nvcc --version": MACHINES["rtx4090"]["nvcc --version"]}, "--cuda", "86;89")
    assert fast == 'fast build: CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=86;89 -DGGML_RPC=ON -DLLAVA_BUILD=OFF"'
    # asked for, it wins over the AMD GPU the machine also has
    (tmp_path / "r").mkdir()
    fast, _, _, _ = plan(tmp_path / "r", MACHINES["rx7900xtx"], "--cuda", "90")
    assert "-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90" in fast and "HIP" not in fast


@pytest.mark.parametrize("archs, code, says", [("61", 1, "compute capability 61 is older than CUDA 13 builds for"),
                                               ("sm90", 2, "--cuda needs compute capabilities such as 90"),
                                               ("", 2, "--cuda needs compute capabilities")])
def test_cuda_archs_it_cannot_build_for_are_refused_in_one_line(tmp_path, archs, code, says):
    done = run_plan(tmp_path, {}, "--cuda", archs)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code and len(lines) == 1 and says in lines[0], done.stderr


def test_nvcc_without_a_gpu_and_rocm_without_a_gpu_agent_are_cpu_builds(tmp_path):
    answers = {"nvcc --version": MACHINES["rtx4090"]["nvcc --version"],
               "rocminfo": rocminfo("gfx000", "gfx000", "")}       # no GPU agent: gfx000 only
    fast, exact, models = plan(tmp_path, answers)
    assert "GGML_CUDA" not in fast and "GGML_HIP" not in fast
    assert exact.startswith("exact build: ggml's CPU backend alone")
    assert models == "models: every one in models.txt"


@pytest.mark.skipif(platform.machine() != "x86_64" or platform.system() != "Linux", reason="x86-64 Linux flags")
def test_a_cpu_machine_names_the_simd_extensions_it_has_and_never_native(tmp_path):
    have = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("flags")).split(":", 1)[1].split())
    fast, exact, _ = plan(tmp_path, {})
    assert "-DGGML_NATIVE=OFF" in fast and "GGML_NATIVE=ON" not in fast
    assert ("-DGGML_AVX2=ON" in fast) == ("avx2" in have)
    assert ("-DGGML_AVX512=ON" in fast) == ("avx512f" in have)
    assert "ggml's CPU backend alone" in exact and exact.count("-DGGML_AVX=ON") == ("avx" in have)


def test_the_users_cmake_args_win_and_the_plan_changes_nothing(tmp_path):
    before = sorted(os.listdir(SETUP.parent.parent))
    fast, exact, models = plan(tmp_path, MACHINES["rtx4090"], CMAKE_ARGS="-DGGML_VULKAN=ON",
                               FLYLOCAL_EXACT_CMAKE_ARGS="-DGGML_NATIVE=OFF")
    assert fast == 'fast build: CMAKE_ARGS="-DGGML_VULKAN=ON -DGGML_RPC=ON -DLLAVA_BUILD=OFF"'
    assert exact == 'exact build: a CPU build of its own, CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_RPC=ON -DLLAVA_BUILD=OFF"'
    assert sorted(os.listdir(SETUP.parent.parent)) == before and not (tmp_path / ".cache").exists()


def test_the_device_check_says_how_it_is_used_and_refuses_unknown_options():
    done = subprocess.run([shutil.which("bash"), str(SETUP.parent / "device_check.sh"), "--nonsense"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    for call in ("--prepare", "--dry-run", "--cpu", "--measure", 'carry=[".device"]'):
        assert call in done.stdout
