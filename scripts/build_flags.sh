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
  if [ -n "${FLYLOCAL_CUDA_ARCHS:-}" ]; then      # setup.sh --cuda ARCHS: asked for, whatever GPU is here
    echo "-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$FLYLOCAL_CUDA_ARCHS"; return
  fi
  if command -v rocminfo >/dev/null 2>&1 && rocminfo 2>/dev/null | grep -q 'gfx[1-9]'; then
    # The GPU agents' ISAs (gfx1100, gfx942, ...), each once; gfx000 is no GPU.
    local targets
    targets=$(rocminfo | grep -o 'gfx[0-9a-f]*' | grep -v '^gfx0*$' | sort -u | paste -sd';' -)
    echo "-DGGML_HIP=ON -DAMDGPU_TARGETS=$targets"; return
  fi
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then
    # Only this machine's architectures ("8.9" -> 89): a build for every one takes far longer.
    # CUDA's compiler is the toolkit's where nvcc is found, else NVIDIA's wheels (cuda_from_pypi).
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

# CUDA's compiler, runtime and cuBLAS from PyPI, for a CUDA build on a machine without a toolkit
# (docs/operations.md, "Builds"). Only CUDA 13's wheels hold a whole compiler (nvcc, cicc, the
# headers); CUDA 12's nvcc wheel holds ptxas alone. 13.0, the oldest 13, runs on every driver
# that runs CUDA 13 (580 on). The wheels go to .venv/cuda, kept apart from site-packages.
CUDA_WHEELS="nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cublas==13.0.2.14 nvidia-cuda-cccl==13.0.85"
CUDA_MIN_ARCH=75           # CUDA 13 builds for Turing and newer only

cuda_from_pypi() {
  # Whether these flags build CUDA on a machine without nvcc: then the compiler comes from PyPI.
  [[ "$1" == *GGML_CUDA=ON* ]] && ! command -v nvcc >/dev/null 2>&1
}

cuda_pypi_root() { echo "$PWD/.venv/cuda/nvidia/cu13"; }

cuda_pypi_args() {
  # What CMake needs to build with the toolkit the wheels make. No libcuda stub comes in them,
  # so ggml's use of the driver's virtual memory API is left out (GGML_CUDA_NO_VMM): its CUDA
  # pool is then cudaMalloc's. A program linked to ggml-cuda finds cuBLAS through -rpath-link.
  local root
  root=$(cuda_pypi_root)
  echo "-DCUDAToolkit_ROOT=$root -DCMAKE_CUDA_COMPILER=$root/bin/nvcc -DGGML_CUDA_NO_VMM=ON -DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath-link,$root/lib"
}

cuda_pypi_refusal() {
  # One line saying why the wheels cannot serve these flags on this machine, or nothing.
  local driver a
  driver=$(nvidia-smi 2>/dev/null | grep -o 'CUDA Version: *[0-9]*' | grep -o '[0-9]*$' || true)
  if [ -n "$driver" ] && [ "$driver" -lt 13 ]; then
    echo "this NVIDIA driver runs CUDA $driver at most, and the CUDA compiler on PyPI is CUDA 13 (driver 580 or newer): install CUDA's toolkit (nvcc), or a newer driver"
    return
  fi
  for a in $(echo "$1" | grep -o 'CMAKE_CUDA_ARCHITECTURES=[^ ]*' | cut -d= -f2 | tr ';' ' '); do
    if [ "${a%%[!0-9]*}" -lt "$CUDA_MIN_ARCH" ]; then
      echo "compute capability ${a%%[!0-9]*} is older than CUDA 13 builds for ($CUDA_MIN_ARCH on); install CUDA 12's toolkit (nvcc)"
      return
    fi
  done
}
