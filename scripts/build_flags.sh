# llama.cpp build flags for this machine, shared by scripts/setup.sh and scripts/device_check.sh
# (sourced, not run): functions only.

cpu_flags() {
  # x86-64: name every SIMD extension this CPU has, never GGML_NATIVE. A native build also
  # enables AMX where the CPU reports it, and dies with SIGILL where the OS grants no AMX state.
  local have f args="-DGGML_NATIVE=OFF"
  have=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
  for f in avx:AVX avx2:AVX2 fma:FMA f16c:F16C avx512f:AVX512 avx512_vnni:AVX512_VNNI \
           avx512_bf16:AVX512_BF16 avx512vbmi:AVX512_VBMI avx_vnni:AVX_VNNI; do
    if [[ " $have " == *" ${f%%:*} "* ]]; then args+=" -DGGML_${f##*:}=ON"; fi
  done
  echo "$args"
}

invariant="-DGGML_LLAMAFILE=OFF -DGGML_CPU_REPACK=OFF"

choose_cmake_args() {
  # The fast build: llama.cpp's default kernels for this machine.
  if [ -n "${CMAKE_ARGS:-}" ]; then
    echo "$CMAKE_ARGS"; return
  fi
  if command -v rocminfo >/dev/null 2>&1 && rocminfo 2>/dev/null | grep -q 'gfx[1-9]'; then
    # The GPU agents' ISAs (gfx1100, gfx942, ...), each once; gfx000 is no GPU.
    local targets
    targets=$(rocminfo | grep -o 'gfx[0-9a-f]*' | grep -v '^gfx0*$' | sort -u | paste -sd';' -)
    echo "-DGGML_HIP=ON -DAMDGPU_TARGETS=$targets"; return
  fi
  if command -v nvcc >/dev/null 2>&1 && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then
    # Only this machine's architectures ("8.9" -> 89): a build for every one takes far longer.
    local archs
    archs=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d ' .' \
            | grep -E '^[0-9]+$' | sort -u | paste -sd';' - || true)
    echo "-DGGML_CUDA=ON${archs:+ -DCMAKE_CUDA_ARCHITECTURES=$archs}"; return
  fi
  case "$(uname -s)-$(uname -m)" in
    Darwin-*) echo "-DGGML_METAL=ON" ;;
    Linux-x86_64) cpu_flags ;;
    *) echo "" ;;
  esac
}

choose_exact_cmake_args() {
  # The exact build: CPU only, with batch-invariant kernels, so that strict decoding can be
  # checked against plain decoding bit for bit (docs/design.md, "Batch invariance").
  if [ -n "${FLYLOCAL_EXACT_CMAKE_ARGS:-}" ]; then
    echo "$FLYLOCAL_EXACT_CMAKE_ARGS"; return
  fi
  case "$(uname -s)-$(uname -m)" in
    Linux-x86_64) echo "$(cpu_flags) $invariant" ;;
    *) echo "$invariant" ;;
  esac
}

with_rpc() {
  # Every build carries the RPC backend, and leaves out llama-cpp-python's multimodal library
  # (mtmd: a quarter of the build's sources; flylocal reads text only), unless the given flags
  # already say otherwise.
  local a="$1"
  if [[ "$a" != *GGML_RPC* ]]; then a="${a:+$a }-DGGML_RPC=ON"; fi
  if [[ "$a" != *LLAVA_BUILD* ]]; then a="$a -DLLAVA_BUILD=OFF"; fi
  echo "$a"
}

cpu_only() {
  # Whether these flags build llama.cpp with no backend but the CPU's (and RPC's).
  [[ ! "$1" =~ GGML_(HIP|CUDA|METAL|VULKAN|SYCL|OPENCL|MUSA|CANN|KOMPUTE|BLAS)=(ON|On|on|1) ]]
}

hip_env() {
  # What llama.cpp's HIP build needs to find ROCm's compiler (its docs/build.md), from hipconfig.
  if [[ "$1" == *GGML_HIP=ON* ]] && command -v hipconfig >/dev/null 2>&1; then
    echo "HIPCXX=$(hipconfig -l)/clang HIP_PATH=$(hipconfig -R)"
  fi
}
