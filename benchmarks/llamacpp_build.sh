#!/usr/bin/env bash
# Builds llama.cpp's `llama-bench` alone: `bash benchmarks/llamacpp_build.sh SRC_DIR BUILD_DIR`, the binary
# lands in BUILD_DIR/bin/llama-bench. CUDA for sm_90 (H100/H200) by default; CPU=1 builds it without CUDA.
# Only what cuts build time without slowing llama.cpp is off: other SM targets, NCCL (one GPU), OpenSSL
# (no downloads), the app/server/tests/examples, flash-attention kernels for quantized KV (the bench keeps f16).
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: [CPU=1] $0 SRC_DIR BUILD_DIR" >&2; exit 2; }
SRC=$1 BUILD=$2
[ -f "$SRC/CMakeLists.txt" ] || { echo "error: $SRC has no CMakeLists.txt" >&2; exit 2; }
# a tree unpacked inside another git repository would record that repository's commit as llama.cpp's
export GIT_CEILING_DIRECTORIES=$(cd "$SRC/.." && pwd)
flags=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
       -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DGGML_CCACHE=OFF)
if [ "${CPU:-0}" = 1 ]; then
  flags+=(-DGGML_CUDA=OFF)
else
  command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
  flags+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_FA_QUANTS=f16-f16
          -DGGML_CUDA_COMPRESSION_MODE=speed)
  # CUDA from pip wheels (nvidia/cu13/...) has only versioned libraries (libcublas.so.13), which CMake's
  # FindCUDAToolkit does not find: name cuBLAS and the driver library to it wherever they are
  nvcc_root=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")  # /usr/local/bin/nvcc may be a wrapper
  pip_dirs=$(python3 -c "import glob, nvidia; print(' '.join(d for p in nvidia.__path__ for d in glob.glob(p + '/*')))" \
             2>/dev/null || true)
  roots=(${CUDA_HOME:-} ${CUDA_PATH:-} "$nvcc_root" /usr/local/cuda $pip_dirs ${CUDA_EXTRA_DIRS:-})
  find_one() {  # find_one SUBDIR PATTERN...: the first match under the roots above
    local sub=$1 d p f; shift
    for d in "${roots[@]}"; do
      for p in "$@"; do for f in "$d"/$sub/$p; do [ -e "$f" ] && { echo "$f"; return 0; }; done; done
    done
    return 0
  }
  for lib in cublas cublasLt; do
    f=$(find_one "lib*" "lib$lib.so" "lib$lib.so.[0-9]*")
    if [ -n "$f" ]; then flags+=(-DCUDA_${lib}_LIBRARY="$f"); fi
  done
  driver=$(ldconfig -p 2>/dev/null | awk '$1 == "libcuda.so.1" {print $NF; exit}')
  for d in ${LD_LIBRARY_PATH:+${LD_LIBRARY_PATH//:/ }} /usr/local/nvidia/lib64 /usr/lib/x86_64-linux-gnu /usr/lib64; do
    if [ -z "$driver" ] && [ -e "$d/libcuda.so.1" ]; then driver=$d/libcuda.so.1; fi
  done
  if [ -z "$driver" ]; then driver=$(find_one "lib*/stubs" libcuda.so); fi
  if [ -n "$driver" ]; then flags+=(-DCUDA_cuda_driver_LIBRARY="$driver")
  else echo "warning: no libcuda found: building without CUDA VMM (its memory pool)" >&2; flags+=(-DGGML_CUDA_NO_VMM=ON)
  fi
  header=$(find_one include cublas_v2.h)
  case "$(dirname "${header:-/}")" in
    /|"$nvcc_root/include"|/usr/local/cuda/include) ;;
    *) flags+=(-DCMAKE_CUDA_FLAGS="-I$(dirname "$header")") ;;
  esac
fi
cmake -S "$SRC" -B "$BUILD" "${flags[@]}" ${CMAKE_ARGS:-}
cmake --build "$BUILD" -j "${JOBS:-$(nproc)}" --target llama-bench
"$BUILD/bin/llama-bench" --help >/dev/null && echo "built $BUILD/bin/llama-bench"
