"""scripts/device_check.sh's steps, without a GPU: --prepare exits 0 once it has written what
travels (llama.cpp's source from an sdist at hand instead of the network), and each step run
before --prepare says in one line that --prepare comes first."""

import hashlib
import os
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "device_check.sh"
VERSION = "0.3.36"


def fake_sdist(folder: Path) -> Path:
    """A llama-cpp-python sdist with the layout --prepare trims: the vendored llama.cpp's
    build files and sources, one small file each."""
    top = folder / f"llama_cpp_python-{VERSION}"
    src = top / "vendor" / "llama.cpp"
    files = ["CMakeLists.txt", "LICENSE", "cmake/common.cmake", "include/llama.h", "src/llama.cpp",
             "vendor/CMakeLists.txt", *(f"vendor/{d}/x.h" for d in ("hash", "miniaudio", "nlohmann", "sheredom", "stb")),
             "ggml/CMakeLists.txt", "ggml/cmake/ggml.cmake", "ggml/include/ggml.h", "ggml/src/ggml.c",
             *(f"ggml/src/{d}/x.c" for d in ("ggml-cpu", "ggml-cuda", "ggml-hip", "ggml-rpc")),
             "ggml/src/ggml-vulkan/left-out.c", "tools/server/left-out.cpp"]
    for name in files:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(f"// {name}\n")
    out = folder / f"llama_cpp_python-{VERSION}.tar.gz"
    with tarfile.open(out, "w:gz") as tar:
        tar.add(top, arcname=top.name)
    return out


def script(*args, env=None, timeout=300):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_prepare_exits_0_and_writes_what_travels(tmp_path):
    dev, cache = tmp_path / "dev", tmp_path / "models"
    cache.mkdir()
    model = cache / "smollm2-135m-instruct.gguf"      # stands in for the weights: --prepare only splits it
    model.write_bytes(b"GGUF" + os.urandom(100_001))
    done = script("--prepare", env={"FLYLOCAL_DEVICE_DIR": str(dev), "FLYLOCAL_DEVICE_SDIST": str(fake_sdist(tmp_path)),
                                    "FLYLOCAL_MODELS": str(cache)})
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "unbound variable" not in done.stderr
    with tarfile.open(dev / "llama.cpp.tar.xz") as tar:
        names = set(tar.getnames())
    assert "./ggml/src/ggml-cuda/x.c" in names and "./src/llama.cpp" in names
    assert not any("left-out" in n for n in names)              # trimmed to libllama's backends
    assert (dev / "site" / "click").is_dir() and (dev / "site" / "llama_cpp").is_dir()
    whole = (tmp_path / "dev-first" / "smollm2.part0").read_bytes() + (dev / "models" / "smollm2.part1").read_bytes()
    assert hashlib.sha256(whole).hexdigest() == (dev / "models" / "smollm2.sha256").read_text().strip()
    assert whole == model.read_bytes()


def test_prepare_without_the_model_says_setup_comes_first(tmp_path):
    done = script("--prepare", env={"FLYLOCAL_DEVICE_DIR": str(tmp_path / "dev"),
                                    "FLYLOCAL_DEVICE_SDIST": str(fake_sdist(tmp_path)),
                                    "FLYLOCAL_MODELS": str(tmp_path / "empty")})
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and "scripts/setup.sh first" in last and "missing" in last, done.stderr


def test_steps_out_of_order_say_prepare_comes_first(tmp_path):
    env = {"FLYLOCAL_DEVICE_DIR": str(tmp_path / "nothing")}
    for step in ("--cpu", "--receive", ""):
        done = script(*([step] if step else []), env=env)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1, (step, done.stderr)
        assert "--prepare first" in lines[0] and "missing" in lines[0]


def test_an_unknown_step_prints_the_usage(tmp_path):
    done = script("--bogus")
    assert done.returncode == 2 and "--prepare" in done.stdout and "set -euo" not in done.stdout
