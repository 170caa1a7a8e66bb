#!/usr/bin/env bash
# One call that answers the GPU questions on a lent accelerator (an NVIDIA H100 or H200 with
# CUDA 13's compiler, CMake and Python 3.12 with numpy, no network, a working tree of at most
# 64 MiB, ten minutes a command), or the same checks on this machine's CPU (--cpu).
#
#   scripts/device_check.sh --prepare   here, once: write .device/ (ignored by git), what travels:
#                                       llama.cpp built here for compute capability 9.0 with CUDA
#                                       13.0's compiler from PyPI (libllama, ggml with CUDA and
#                                       llama-server; stripped, .tar.xz; the build is kept in
#                                       ~/.cache/flylocal/device and not redone), llama.cpp's
#                                       source trimmed to that build's (to build there when the
#                                       carried build cannot run), and the Python packages
#                                       flylocal and its server load that the device lacks
#   scripts/device_check.sh --dry-run   here: list what travels with its sizes, check each part
#                                       (the build's libraries, their CUDA 13 needs, the packages)
#                                       and that the call's total is within 64 MiB; exit 0 if so
#   scripts/device_check.sh             there (carry .device): unpack the carried build, check
#                                       that it loads on that GPU (else say why in one line and
#                                       build there), then measure
#   scripts/device_check.sh --measure   there, a later call on the same warm machine: measure again
#   scripts/device_check.sh --cpu       here: measure the same way on this CPU, with smaller models
#                                       (llama-server from $LLAMA_SERVER, if given)
#
# The measurements, each step's seconds beside its heading:
#   1. models written on the spot (scripts/random_gguf.py): a target shaped like Llama-3.1-8B,
#      draft models shaped like Llama-3.2-1B that agree with it on 60%, 80% and 90% of tokens (a
#      draft accepted token by token with that probability), and SmolLM2-135M's shape; Q4_K_M
#      (SmolLM2's Q4_1, as its registry file);
#   2. the build (flylocal doctor) and where auto puts the target's layers;
#   3. per model, with every layer offloaded: GPU memory used against what flylocal predicts,
#      and t(1..33) (scripts/device_measure.py);
#   4. Spec-Bench questions through servers (flylocal bench serve), one per configuration:
#      flylocal's autoregressive, strict-pld, fly-pld, strict-mla and fly-mla beside
#      llama-server's plain, ngram-mod and draft-simple, at each agreement.
# Everything it prints also goes to $OUT/device_check.txt where $OUT is set (the device tool's
# folder that comes back). It keeps within FLYLOCAL_DEVICE_BUDGET seconds (400): a step that
# would not fit is skipped, saying so. The call, from this repository's root (.device is
# ignored by git and carried):
#   run(command="scripts/device_check.sh", carry=[".device"], timeout_s=420)
# Each step run out of order says in one line which step comes first. For its tests,
# FLYLOCAL_DEVICE_DIR moves .device, FLYLOCAL_DEVICE_BUILD names a build folder to pack instead
# of building, FLYLOCAL_DEVICE_SDIST and FLYLOCAL_DEVICE_WHEELS a llama-cpp-python sdist and a
# folder of wheels at hand instead of the package index's, and FLYLOCAL_DEVICE_QUICK=1 measures
# at a few tokens and one agreement.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/build_flags.sh
source scripts/build_flags.sh

LLAMA_CPP_PYTHON_VERSION=0.3.36
NAME=${FLYLOCAL_DEVICE_DIR:-.device}   # as carried: relative to the repository's root
DEV=$NAME
case "$DEV" in /*) ;; *) DEV="$DEV" ;; esac
ARCH=90                              # the lent H100 and H200
LIMIT=$((64 * 1024 * 1024))          # what one call carries
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/flylocal/device
# What flylocal and its server import that the device's Python lacks: copied from here (pure
# Python) or, where compiled, fetched as wheels for the device's Python 3.12.
SITE_PACKAGES=(click diskcache gguf jinja2 llama_cpp markupsafe typing_extensions.py yaml)
SERVE_WHEELS=(fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.14.4 pydantic-core==2.50.5
              annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5)
LIBS=(libggml-base libggml libggml-cpu libggml-cuda libggml-rpc libllama libllama-common libllama-server-impl libmtmd)
# The build: CUDA for one architecture, without flash attention's kernels (both flylocal and
# llama-server run with flash attention "auto", which finds none and attends without), with the
# CPU flags of x86-64-v3, which every H100 host has.
FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_RPC=ON -DGGML_CUDA=ON
       -DCMAKE_CUDA_ARCHITECTURES=$ARCH-real -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_NO_VMM=ON"
say() { echo "device_check: $*" >&2; }
# One line saying which step comes first, and exit 1.
first() { say "$1 first: $2"; exit 1; }

TMP=""                               # scratch, removed on exit however it ends
trap '[ -z "$TMP" ] || rm -rf "$TMP"' EXIT
trap 'exit 130' INT                  # bash runs the EXIT trap on a signal only through exit

sdist_source() {
  # llama-cpp-python's sdist, unpacked in $TMP once; prints its vendored llama.cpp folder.
  if ls -d "$TMP"/llama_cpp_python-*/vendor/llama.cpp >/dev/null 2>&1; then
    echo "$TMP"/llama_cpp_python-*/vendor/llama.cpp; return
  elif [ -n "${FLYLOCAL_DEVICE_SDIST:-}" ]; then
    cp "$FLYLOCAL_DEVICE_SDIST" "$TMP/"
  else
    .venv/bin/python -m pip download -q --no-deps --no-binary :all: -d "$TMP" \
      "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" >&2
  fi
  tar xzf "$TMP"/llama_cpp_python-*.tar.gz -C "$TMP"
  echo "$TMP"/llama_cpp_python-*/vendor/llama.cpp
}

build_here() {
  # The carried build, made here with CUDA 13.0's compiler from PyPI and kept in $CACHE/<key>;
  # prints its folder. FLYLOCAL_DEVICE_BUILD names one already made instead.
  if [ -n "${FLYLOCAL_DEVICE_BUILD:-}" ]; then echo "$FLYLOCAL_DEVICE_BUILD"; return; fi
  local key out root src start
  key=$(printf '%s %s %s' "$LLAMA_CPP_PYTHON_VERSION" "$FLAGS" "$CUDA_WHEELS" | sha256sum | cut -c1-16)
  out="$CACHE/$key"
  if [ -f "$out/done" ]; then say "using the build made earlier ($out)"; echo "$out"; return; fi
  root="$CACHE/cuda/nvidia/cu13"
  if [ ! -x "$root/bin/nvcc" ]; then
    say "CUDA 13.0's compiler, runtime and cuBLAS from PyPI into $CACHE/cuda"
    # shellcheck disable=SC2086 # the wheels are words
    .venv/bin/python -m pip install -q --no-compile --target "$CACHE/cuda" $CUDA_WHEELS >&2
    ln -sfn lib "$root/lib64"
    for lib in cudart cublas cublasLt; do ln -sfn "lib$lib.so.13" "$root/lib/lib$lib.so"; done
  fi
  src=$(sdist_source)
  say "building llama.cpp for compute capability $ARCH (about 20 minutes on 2 cores)"
  start=$(date +%s)
  rm -rf "$out" && mkdir -p "$out"
  # shellcheck disable=SC2086 # the flags are words
  { cmake -G Ninja -S "$src" -B "$out/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF \
      -DCUDAToolkit_ROOT="$root" -DCMAKE_CUDA_COMPILER="$root/bin/nvcc" -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,$root/lib" \
      $FLAGS \
    && ninja -C "$out/build" llama llama-server; } > "$out/build.log" 2>&1 \
    || { tail -30 "$out/build.log" >&2; say "the build failed (the lines above)"; exit 1; }
  echo "$(( $(date +%s) - start )) s on $(nproc) cores" > "$out/done"
  echo "$out"
}

pack() {
  # $1/build/bin's libraries and llama-server, stripped, into $DEV/build.tar.xz.
  local bin="$1/build/bin" lib
  mkdir -p "$TMP/pack"
  for lib in "${LIBS[@]}"; do
    [ -f "$bin/$lib.so" ] || first "a CUDA build" "$bin/$lib.so is missing (the build folder is not one --prepare made)"
    cp -L "$bin/$lib.so" "$TMP/pack/$(basename "$(readlink -f "$bin/$lib.so")" | sed 's/\(\.so\.[0-9]*\)\..*/\1/')"
  done
  cp "$bin/llama-server" "$TMP/pack/"
  strip --strip-unneeded "$TMP"/pack/*
  (cd "$TMP/pack" && for f in *.so.*; do ln -sf "$f" "${f%%.so.*}.so"; done)
  tar cJf "$DEV/build.tar.xz" -C "$TMP/pack" .
}

prepare() {
  local build src site
  TMP=$(mktemp -d)
  build=$(build_here)
  rm -rf "$DEV" && mkdir -p "$DEV/site"
  say "packing the build (stripped, .tar.xz)"
  pack "$build"
  say "llama.cpp's source, trimmed to this build's (for a build there when the carried one cannot run)"
  src=$(sdist_source)
  mkdir -p "$TMP/trim/ggml/src"
  cp -a "$src"/{CMakeLists.txt,LICENSE,cmake,common,include,src,tools,vendor} "$TMP/trim/"   # tools: CMake adds each
  cp -a "$src"/ggml/{CMakeLists.txt,cmake,include} "$TMP/trim/ggml/"
  find "$src/ggml/src" -maxdepth 1 -type f -exec cp -a {} "$TMP/trim/ggml/src/" \;
  cp -a "$src"/ggml/src/{ggml-cpu,ggml-cuda,ggml-rpc} "$TMP/trim/ggml/src/"
  tar cJf "$DEV/llama.cpp.tar.xz" -C "$TMP/trim" .
  say "the Python packages flylocal and its server load (numpy, anyio and h11 are there already)"
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  for p in "${SITE_PACKAGES[@]}"; do cp -a "$site/$p" "$DEV/site/"; done
  rm -rf "$DEV/site/llama_cpp/lib" && find "$DEV/site" -name '__pycache__' -prune -exec rm -rf {} + \
    && find "$DEV/site" -name '*.so' -delete        # compiled speed-ups: each has a pure-Python fallback
  if [ -n "${FLYLOCAL_DEVICE_WHEELS:-}" ]; then
    mkdir -p "$TMP/wheels" && cp "$FLYLOCAL_DEVICE_WHEELS"/*.whl "$TMP/wheels/"
  else
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$TMP/wheels" "${SERVE_WHEELS[@]}" >&2
  fi
  for w in "$TMP"/wheels/*.whl; do .venv/bin/python -m zipfile -e "$w" "$DEV/site/"; done    # a wheel is its files
  find "$DEV/site" -name '*.dist-info' -prune -exec rm -rf {} +
  dry_run
  say "prepared: carry $NAME (run(command=\"scripts/device_check.sh\", carry=[\"$NAME\"], timeout_s=420))"
}

dry_run() {
  # What travels and whether it can: each part listed with its size, checked, and the total.
  local total=0 size part missing=0 needs
  [ -e "$DEV/build.tar.xz" ] || first "scripts/device_check.sh --prepare" "$DEV/build.tar.xz is missing (--prepare writes what travels)"
  for part in "$DEV/build.tar.xz" "$DEV/llama.cpp.tar.xz" "$DEV/site"; do
    [ -e "$part" ] || { say "$part is missing"; missing=1; continue; }
    size=$(du -sb "$part" | cut -f1)
    total=$((total + size))
    printf '%-28s %8.1f MiB\n' "$part" "$(echo "$size / 1048576" | bc -l)"
  done
  [ "$missing" = 0 ] || first "scripts/device_check.sh --prepare" "what travels is missing (the lines above)"
  size=$({ git ls-files -z; git ls-files -z -o --exclude-standard; } | xargs -0 du -cb 2>/dev/null | grep total$ \
         | cut -f1 | paste -sd+ - | bc)
  total=$((total + size))
  printf '%-28s %8.1f MiB\n' "the working tree" "$(echo "$size / 1048576" | bc -l)"
  tar tJf "$DEV/build.tar.xz" | sed 's|^\./||' | grep -v '^$' | sort > "${TMP:-/tmp}/.device-list.$$"
  for part in "${LIBS[@]}" llama-server; do
    grep -q "^$part" "${TMP:-/tmp}/.device-list.$$" || { say "$DEV/build.tar.xz lacks $part"; missing=1; }
  done
  rm -f "${TMP:-/tmp}/.device-list.$$"
  needs=$(tar xJOf "$DEV/build.tar.xz" --wildcards './libggml-cuda.so.*' | grep -a -o 'lib\(cudart\|cublas\|cublasLt\)\.so\.[0-9]*' | sort -u | paste -sd' ' -)
  echo "libggml-cuda needs: ${needs:-no CUDA library}"
  [[ "$needs" == *libcudart.so.13* && "$needs" == *libcublas.so.13* ]] || { say "the carried libggml-cuda does not link CUDA 13's runtime and cuBLAS"; missing=1; }
  for part in fastapi starlette uvicorn pydantic pydantic_core click gguf llama_cpp; do
    [ -e "$DEV/site/$part" ] || { say "$DEV/site lacks $part"; missing=1; }
  done
  ls "$DEV"/site/pydantic_core/_pydantic_core.cpython-312-x86_64-linux-gnu.so >/dev/null 2>&1 \
    || { say "$DEV/site lacks pydantic_core's library for Python 3.12"; missing=1; }
  printf '%-28s %8.1f MiB of %d\n' "one call carries" "$(echo "$total / 1048576" | bc -l)" $((LIMIT / 1048576))
  [ "$total" -le "$LIMIT" ] || { say "that is over the 64 MiB a call carries"; exit 1; }
  [ "$missing" = 0 ] || exit 1
}

unpack() {
  # The carried build into $DEV/lib; if it does not load on this machine's GPU, say why and
  # build there from the trimmed source.
  [ -f "$DEV/build.tar.xz" ] || first "scripts/device_check.sh --prepare" \
    "$DEV/build.tar.xz is missing (--prepare writes it here; the call needs $DEV carried)"
  rm -rf "$DEV/lib" && mkdir -p "$DEV/lib" && tar xJf "$DEV/build.tar.xz" -C "$DEV/lib"
  environment "$DEV/lib"
  local why
  if why=$("$PY" -c 'import flylocal.llama.binding
from flylocal.llama.devices import gpu_offload, local_devices
assert gpu_offload(), "no GPU backend"
print(local_devices()[0].description)' 2>&1); then
    say "the carried build runs here: $(echo "$why" | tail -1)"
    return
  fi
  say "the carried build does not run here ($(echo "$why" | grep -v '^ ' | tail -1)): building there"
  build_there
}

build_there() {
  # libllama and llama-server from the trimmed source, for this machine's GPU, into $DEV/lib.
  local archs flags
  [ -f "$DEV/llama.cpp.tar.xz" ] || first "scripts/device_check.sh --prepare" "$DEV/llama.cpp.tar.xz is missing"
  command -v nvcc >/dev/null 2>&1 || { say "no nvcc here to build with"; exit 1; }
  archs=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | tr -d ' .' | sort -u | paste -sd';' -)
  flags=$(echo "$FLAGS" | sed "s/CMAKE_CUDA_ARCHITECTURES=[^ ]*/CMAKE_CUDA_ARCHITECTURES=${archs:-$ARCH}-real/")
  rm -rf "$DEV/src" && mkdir -p "$DEV/src" && tar xJf "$DEV/llama.cpp.tar.xz" -C "$DEV/src"
  # shellcheck disable=SC2086 # the flags are words
  { cmake -G Ninja -S "$DEV/src" -B "$DEV/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF \
      $flags \
    && ninja -C "$DEV/build" llama llama-server; } > "$DEV/build.log" 2>&1 \
    || { tail -30 "$DEV/build.log" >&2; say "the build failed (the lines above)"; exit 1; }
  cp -a "$DEV"/build/bin/*.so* "$DEV/build/bin/llama-server" "$DEV/lib/"
}

environment() {
  # Where the measuring processes find llama.cpp ($1), CUDA's libraries and the carried packages.
  PY=python3
  [ -x .venv/bin/python ] && [ -z "${1:-}" ] && PY=.venv/bin/python
  export PYTHONPATH="$PWD${1:+:$DEV/site}" FLYLOCAL_COSTS="$DEV/costs" FLYLOCAL_MODELS="$DEV/models"
  if [ -n "${1:-}" ]; then
    export LLAMA_CPP_LIB_PATH="$1"
    # llama-server finds its libraries and CUDA's (a toolkit's, or the wheels' of the device's Python)
    local wheels
    wheels=$("$PY" -c 'from flylocal.llama import cuda; print(":".join(map(str, cuda.wheel_dirs())))' 2>/dev/null || true)
    export LD_LIBRARY_PATH="$1${wheels:+:$wheels}:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
}

left() {
  # Seconds left of the budget, less a margin for what follows (at least 1).
  local n=$(( DEADLINE - SECONDS - 10 ))
  echo $(( n > 1 ? n : 1 ))
}

step() {
  # A heading with the seconds since the last one.
  local now
  now=$(date +%s.%N)
  [ -z "${STEP_AT:-}" ] || printf '   (%.1f s)\n' "$(echo "$now - $STEP_AT" | bc -l)"
  STEP_AT=$now
  [ -z "$1" ] || echo "## $1"
}

measure() {
  # $1: gpu or cpu. The sizes, the agreements and the answers' length follow.
  local target draft small shape dtype agrees tokens per p modes server=${LLAMA_SERVER:-} m
  local models="$DEV/models"
  mkdir -p "$models"
  if [ "$1" = gpu ]; then
    target=llama-8b draft=llama-1b dtype=Q4_K_M agrees="0.6 0.8 0.9" tokens=128
    [ -n "$server" ] || server="$DEV/lib/llama-server"
  else
    target=smollm2 draft=tiny dtype=Q4_1 agrees="0.8" tokens=64
  fi
  if [ -n "${FLYLOCAL_DEVICE_QUICK:-}" ]; then agrees=${agrees%% *} tokens=8; fi
  step "models: $target-shaped target, $draft-shaped drafts agreeing ${agrees// /, }, smollm2-shaped"
  small="$models/smollm2.gguf"
  [ -f "$small" ] || "$PY" scripts/random_gguf.py "$small" --shape smollm2 --type Q4_1
  shape=$([ "$target" = smollm2 ] && echo Q4_1 || echo "$dtype")
  [ -f "$models/target.gguf" ] || "$PY" scripts/random_gguf.py "$models/target.gguf" --shape "$target" --type "$shape"
  for p in $agrees; do
    [ -f "$models/draft-$p.gguf" ] || "$PY" scripts/random_gguf.py "$models/draft-$p.gguf" --shape "$draft" \
      --type "$shape" --agree "$p" --vocab "$("$PY" -c "import sys; sys.path.insert(0, 'scripts'); import random_gguf as r; print(r.SHAPES['$target'][5])")"
  done
  for m in "$models"/*.gguf; do echo "$(basename "$m") $(( $(stat -c %s "$m") / 1000000 )) MB"; done
  step "build"
  if timeout "$(left)" "$PY" -X faulthandler -m flylocal doctor --model "$models/target.gguf" > "$DEV/doctor.log" 2>&1; then
    sed -n '1,/^$/p' "$DEV/doctor.log"
  else
    tail -20 "$DEV/doctor.log"; say "flylocal doctor failed: the lines above; the measurements go on"
  fi
  step "memory and t(1..33), every layer offloaded"
  timeout "$(left)" "$PY" -X faulthandler scripts/device_measure.py "$small" "$models/target.gguf" "$models/draft-${agrees%% *}.gguf" \
    ${FLYLOCAL_DEVICE_QUICK:+--rows 3} || say "scripts/device_measure.py failed; the measurements go on"
  per=1
  for p in $agrees; do
    step "Spec-Bench through servers, draft agreeing $p"
    m=(--server autoregressive --server strict-mla --server fly-mla)
    [ "$p" != "${agrees%% *}" ] || m+=(--server strict-pld --server fly-pld)
    if [ -n "$server" ] && [ -x "$server" ]; then
      m+=(--llama-server "$server" --server llama-server --server llama-server-draft)
      [ "$p" != "${agrees%% *}" ] || m+=(--server llama-server-ngram)
    elif [ "$p" = "${agrees%% *}" ]; then
      say "no llama-server (${server:-set LLAMA_SERVER}): llama-server's modes are skipped"
    fi
    m+=(--target "$models/target.gguf" --draft "$models/draft-$p.gguf" --raw --per-category "$per"
        --max-tokens "$tokens" --pause 0.1)
    [ "$1" = gpu ] || m+=(--threads "$(nproc)")
    if [ "$(left)" -lt 45 ]; then say "no time left for the servers' run at $p (FLYLOCAL_DEVICE_BUDGET)"; continue; fi
    timeout "$(left)" "$PY" -m flylocal bench serve "${m[@]}" || say "the servers' run at $p failed or ran out of time"
  done
  step ""
}

DEADLINE=$((SECONDS + ${FLYLOCAL_DEVICE_BUDGET:-400}))
if [ -n "${OUT:-}" ] && [ -d "$OUT" ] && [[ "${1:-}" != --prepare && "${1:-}" != --dry-run ]]; then
  exec > >(tee "$OUT/device_check.txt") 2>&1
fi
case "${1:-}" in
  --prepare) prepare ;;
  --dry-run) dry_run ;;
  --cpu) environment ""; measure cpu ;;
  --measure) [ -d "$DEV/lib" ] || first "scripts/device_check.sh" "no build in $DEV/lib (the first call unpacks it)"
             environment "$DEV/lib"; measure gpu ;;
  "") unpack && measure gpu ;;
  *) sed -n '2,44p' "$0"; exit 2 ;;
esac
