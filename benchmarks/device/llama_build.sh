#!/bin/bash
# Build llama.cpp's tools from the carried source tree (device machine; no network).
# usage: bash benchmarks/device/llama_build.sh WORK KIND LOG
#   KIND cuda: llama-imatrix + llama-quantize with CUDA for sm_90 (WORK/llama.cpp/build-cuda/bin; ~5 min, $JOBS jobs)
#   KIND cpu:  the same tools on the CPU (WORK/llama.cpp/build-cpu/bin; ~40 s)
#   KIND ggml: a shared libggml-base.so for encode_speed.py --libggml (WORK/llama.cpp/build-ggml/bin; seconds)
# env: LLAMA_SRC_TAR (default .dev/llama-src.tar.xz of the checkout), JOBS (default nproc - 2),
#      SHARED (cuda: ON builds libggml*.so / libllama.so beside the tools, so that the CUDA code is in one file a few
#      tens of MB and the tools can be packed by llama_pack.sh and carried to a later call instead of built again).
# Writes WORK/build-KIND.ok or WORK/build-KIND.failed when done (the log: LOG).
set -uo pipefail
WORK=$1; KIND=$2; LOG=$3
REPO=$(cd "$(dirname "$0")/../.." && pwd)
TAR=${LLAMA_SRC_TAR:-$REPO/.dev/llama-src.tar.xz}
JOBS=${JOBS:-$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))}
mkdir -p "$WORK"; rm -f "$WORK/build-$KIND.ok" "$WORK/build-$KIND.failed"
build() {  # every step checked: set -e does not hold inside a function called in an if
  local T0; T0=$(date +%s)
  if [ ! -f "$WORK/llama.cpp/CMakeLists.txt" ]; then tar xJf "$TAR" -C "$WORK" || return 1; fi
  cd "$WORK/llama.cpp" || return 1
  local COMMON=(-G Ninja -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
                -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release)
  case $KIND in
    cuda)
      if ! command -v nvcc >/dev/null; then
        for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do [ -x "$d/nvcc" ] && export PATH="$d:$PATH" && break; done
      fi
      nvcc --version | tail -2 || return 1
      cmake -B build-cuda "${COMMON[@]}" -DBUILD_SHARED_LIBS=${SHARED:-OFF} -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 || return 1
      cmake --build build-cuda -j "$JOBS" --target llama-imatrix llama-quantize || return 1 ;;
    cpu)
      cmake -B build-cpu "${COMMON[@]}" -DBUILD_SHARED_LIBS=OFF || return 1
      cmake --build build-cpu -j "$JOBS" --target llama-imatrix llama-quantize || return 1 ;;
    ggml)
      cmake -B build-ggml "${COMMON[@]}" -DBUILD_SHARED_LIBS=ON || return 1
      cmake --build build-ggml -j "$JOBS" --target ggml-base || return 1 ;;
    *) echo "unknown KIND $KIND"; return 2 ;;
  esac
  echo "build $KIND done in $(( $(date +%s) - T0 )) s"
}
if build > "$LOG" 2>&1; then
  touch "$WORK/build-$KIND.ok"
else
  touch "$WORK/build-$KIND.failed"; tail -20 "$LOG"; exit 1
fi
