#!/usr/bin/env bash
# One call that answers the GPU questions on a lent accelerator (an NVIDIA machine with CUDA's
# compiler, CMake and numpy, no network, a working tree of at most 64 MiB, ten minutes a
# command), or the same checks on this machine's CPU (--cpu).
#
#   scripts/device_check.sh --prepare   here, once: write what travels (ignored by git):
#                                       .device/ holds llama.cpp's source trimmed to libllama's
#                                       (the copy llama-cpp-python's sdist vendors: 1.2 MB as
#                                       .tar.xz), the pure-Python packages flylocal loads and the
#                                       second half of SmolLM2-135M (Q4_1, 98 MB: no smaller
#                                       requantization exists, its rows of 576 are no multiple of
#                                       the K-quants' 256); .device-first/ holds the first half
#   scripts/device_check.sh --receive   there, first call (carry .device-first): keep the first
#                                       half in build/ (ignored outputs stay between calls)
#   scripts/device_check.sh             there, second call (carry .device): build libllama with
#                                       CUDA for that GPU's architecture only, then measure
#   scripts/device_check.sh --measure   there, a later call on the same warm machine (no carry:
#                                       the build from the call before stays): measure again
#   scripts/device_check.sh --cpu       here: the same, built for this CPU
#
# It prints: t(1..33), the decode seconds of 1..33 rows with every layer offloaded, of SmolLM2
# and of a Llama-3.2-1B-shaped model with random weights (written on the spot); tokens/s of
# plain, strict-pld, fly-pld and strict-mla on Spec-Bench questions (SmolLM2 as target and
# draft); and the host work per round (scripts/bench/host.py). Without the first half (the
# machine went back between the calls) SmolLM2's parts are skipped, and said so. The calls:
#   run(command="scripts/device_check.sh --receive", carry=[".device-first"], timeout_s=60)
#   run(command="scripts/device_check.sh", carry=[".device"], timeout_s=580)
# Each step says in one line which step comes first when run out of order. For its test, two
# variables move what --prepare reads and writes: FLYLOCAL_DEVICE_DIR (instead of .device) and
# FLYLOCAL_DEVICE_SDIST (a llama-cpp-python sdist at hand, instead of downloading it).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/build_flags.sh
source scripts/build_flags.sh

LLAMA_CPP_PYTHON_VERSION=0.3.36
DEV=${FLYLOCAL_DEVICE_DIR:-.device}
SITE_PACKAGES=(click diskcache gguf jinja2 llama_cpp markupsafe typing_extensions.py yaml)
say() { echo "device_check: $*" >&2; }
# One line saying which step comes first, and exit 1.
first() { say "$1 first: $2"; exit 1; }

TMP=""                               # --prepare's scratch folder, removed on exit however it ends
trap '[ -z "$TMP" ] || rm -rf "$TMP"' EXIT
trap 'exit 130' INT                  # bash runs the EXIT trap on a signal only through exit

prepare() {
  local site src
  TMP=$(mktemp -d)
  rm -rf "$DEV" && mkdir -p "$DEV/models" "$DEV/site"
  say "llama.cpp's source, trimmed to libllama with the CPU, CUDA, HIP and RPC backends"
  if [ -n "${FLYLOCAL_DEVICE_SDIST:-}" ]; then
    cp "$FLYLOCAL_DEVICE_SDIST" "$TMP/"
  else
    .venv/bin/python -m pip download -q --no-deps --no-binary :all: -d "$TMP" \
      "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
  fi
  tar xzf "$TMP"/llama_cpp_python-*.tar.gz -C "$TMP"
  src=$(echo "$TMP"/llama_cpp_python-*/vendor/llama.cpp)
  mkdir -p "$TMP/trim/ggml/src"
  cp -a "$src"/{CMakeLists.txt,LICENSE,cmake,include,src} "$TMP/trim/"
  mkdir -p "$TMP/trim/vendor"        # llama.cpp's CMakeLists adds vendor/ whatever is built
  cp -a "$src"/vendor/{CMakeLists.txt,hash,miniaudio,nlohmann,sheredom,stb} "$TMP/trim/vendor/"
  cp -a "$src"/ggml/{CMakeLists.txt,cmake,include} "$TMP/trim/ggml/"
  find "$src/ggml/src" -maxdepth 1 -type f -exec cp -a {} "$TMP/trim/ggml/src/" \;
  cp -a "$src"/ggml/src/{ggml-cpu,ggml-cuda,ggml-hip,ggml-rpc} "$TMP/trim/ggml/src/"
  tar cJf "$DEV/llama.cpp.tar.xz" -C "$TMP/trim" .
  say "the Python packages flylocal loads (numpy is there already)"
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  for p in "${SITE_PACKAGES[@]}"; do cp -a "$site/$p" "$DEV/site/"; done
  rm -rf "$DEV/site/llama_cpp/lib" && find "$DEV/site" -name '__pycache__' -prune -exec rm -rf {} + \
    && find "$DEV/site" -name '*.so' -delete        # compiled speed-ups: each has a pure-Python fallback
  say "SmolLM2-135M in two halves, one for each call"
  local model half
  model=$(.venv/bin/python -c "from flylocal import models; print(models.local_path('smollm2-135m-instruct'))")
  [ -f "$model" ] || first "scripts/setup.sh" "$model is missing (setup fetches SmolLM2-135M; --prepare splits it)"
  half=$(( ($(stat -c %s "$model") + 1) / 2 ))
  rm -rf "$DEV-first" && mkdir -p "$DEV-first"
  head -c "$half" "$model" > "$DEV-first/smollm2.part0"
  tail -c +"$((half + 1))" "$model" > "$DEV/models/smollm2.part1"
  sha256sum "$model" | cut -d' ' -f1 > "$DEV/models/smollm2.sha256"
  du -sh "$DEV" "$DEV-first" >&2
  say "prepared: carry $DEV-first to --receive, then $DEV to the measuring call"
}

receive() {
  [ -f "$DEV-first/smollm2.part0" ] || first "scripts/device_check.sh --prepare" \
    "$DEV-first/smollm2.part0 is missing (--prepare writes it here; --receive needs it carried)"
  mkdir -p build/device && cp "$DEV-first/smollm2.part0" build/device/ && say "kept the first half in build/device"
}

smollm2() {
  # SmolLM2 whole again from its halves; prints its path, or nothing without the first half.
  local out="$DEV/models/smollm2-135m-instruct.gguf" first=build/device/smollm2.part0
  [ -f "$first" ] || [ -f "$DEV-first/smollm2.part0" ] || return 0
  [ -f "$first" ] || first="$DEV-first/smollm2.part0"
  cat "$first" "$DEV/models/smollm2.part1" > "$out"
  [ "$(sha256sum "$out" | cut -d' ' -f1)" = "$(cat "$DEV/models/smollm2.sha256")" ] && echo "$out"
}

build() {
  # libllama from the trimmed source, into $DEV/build/bin.
  local args
  [ -f "$DEV/llama.cpp.tar.xz" ] || first "scripts/device_check.sh --prepare" \
    "$DEV/llama.cpp.tar.xz is missing (--prepare writes it; the measuring call needs $DEV carried)"
  if [ "$1" = gpu ]; then
    args=$(CMAKE_ARGS= choose_cmake_args)
    [[ "$args" == *GGML_CUDA=ON* || "$args" == *GGML_HIP=ON* ]] || { say "no GPU found (nvidia-smi, rocminfo)"; exit 1; }
  else
    args=$(cpu_flags)
  fi
  rm -rf "$DEV/src" && mkdir -p "$DEV/src" && tar xJf "$DEV/llama.cpp.tar.xz" -C "$DEV/src"
  say "building libllama with $args"
  # shellcheck disable=SC2046,SC2086 # the flags and the environment are words
  env $(hip_env "$args") cmake -S "$DEV/src" -B "$DEV/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DGGML_RPC=ON $args > "$DEV/build.log" 2>&1 \
    && cmake --build "$DEV/build" --target llama -j "$(nproc)" >> "$DEV/build.log" 2>&1 \
    || { tail -30 "$DEV/build.log" >&2; say "the build failed (the lines above)"; exit 1; }
}

measure() {
  local smol big="$DEV/models/random-llama-1b.gguf"
  smol=$(smollm2)
  export LLAMA_CPP_LIB_PATH="$PWD/$DEV/build/bin" PYTHONPATH="$PWD/$DEV/site:$PWD" FLYLOCAL_COSTS="$PWD/$DEV/costs"
  export FLYLOCAL_MODELS="$PWD/$DEV/models"
  local py=python3
  [ -x .venv/bin/python ] && py=.venv/bin/python
  say "writing a Llama-3.2-1B-shaped model with random weights"
  [ -f "$big" ] || "$py" scripts/random_gguf.py "$big"
  echo "## build"
  [ -n "$smol" ] || say "the first half of SmolLM2 is not here (run --receive first): SmolLM2's parts are skipped"
  if "$py" -X faulthandler -m flylocal doctor --model "${smol:-$big}" > "$DEV/doctor.log" 2>&1; then
    sed -n '1,/^$/p' "$DEV/doctor.log"
  else
    tail -40 "$DEV/doctor.log"; say "flylocal doctor failed: the lines above; the measurements go on"
  fi
  echo "## t(1..33): decode seconds of n rows, every layer offloaded (median of 5)"
  for m in $smol "$big"; do
    "$py" - "$m" <<'PY'
import statistics, sys, time
import flylocal.llama.binding  # llama.cpp before numpy: flylocal/launch.py says why
import numpy as np
from flylocal.llama.runtime import Runtime, RuntimeConfig
rt = Runtime(sys.argv[1], RuntimeConfig(n_ctx=1024, n_gpu_layers=999))
rt.decode(rt.tokenize("The quick brown fox jumps over the lazy dog. " * 20)[:256])
n_past, t = rt.n_past, []
for rows in range(1, 34):
    batch = np.full(rows, 100, dtype=np.int32)
    runs = []
    for _ in range(6):
        t0 = time.perf_counter()
        rt.decode(batch, logits_from=0).argmax(axis=1)
        runs.append(time.perf_counter() - t0)
        rt.truncate(n_past)
    t.append(statistics.median(runs[1:]))
print(f"{rt.name}: " + " ".join(f"{x * 1e3:.2f}" for x in t) + " ms")
print(f"  t(n)/t(1): " + " ".join(f"{x / t[0]:.2f}" for x in t))
rt.close()
PY
  done
  if [ -n "$smol" ]; then
    echo "## Spec-Bench through flylocal bench (SmolLM2 as target and draft, 128 tokens)"
    "$py" -m flylocal bench --target "$smol" --draft "$smol" --prompts data/spec_bench --per-category 1 \
      --methods autoregressive,strict-pld,fly-pld,strict-mla --max-tokens 128 --out "$DEV/bench" >/dev/null
    cat "$DEV/bench/report.md"
  fi
  echo "## host work per round"
  "$py" scripts/bench/host.py --models "${smol:+$smol,}$big"
}

case "${1:-}" in
  --prepare) prepare ;;
  --receive) receive ;;
  --cpu) build cpu && measure ;;
  --measure) [ -d "$DEV/build/bin" ] || first "scripts/device_check.sh" "no build in $DEV/build (the measuring call builds it)"
             measure ;;
  "") build gpu && measure ;;
  *) sed -n '2,30p' "$0"; exit 2 ;;
esac
