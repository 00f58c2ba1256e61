#!/bin/bash
# Make the trimmed llama.cpp source tree the device scripts carry (here, on the CPU machine; PyPI only): the
# `vendor/llama.cpp` of llama-cpp-python's sdist (the version the dev extra installs, else VERSION) without docs,
# models, media, benches, tests, examples, tools/ui and the GPU backends other than CUDA, as DEST (default
# .dev/llama-src.tar.xz, about 4.4 MB): llama_build.sh, encode.sh and pipeline.sh read it (LLAMA_SRC_TAR).
# usage: bash benchmarks/device/llama_src.sh [DEST]
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
DEST=$(realpath -m "${1:-$REPO/.dev/llama-src.tar.xz}")
VERSION=${VERSION:-$(python3 -c "import importlib.metadata as m; print(m.version('llama_cpp_python'))" 2>/dev/null || echo 0.3.36)}
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
python3 -m pip download -q "llama-cpp-python==$VERSION" --no-binary :all: --no-deps -d "$TMP"
tar xzf "$TMP"/llama_cpp_python-*.tar.gz -C "$TMP"
SRC=$(ls -d "$TMP"/llama_cpp_python-*/vendor/llama.cpp)
cd "$SRC"
rm -rf docs models media benches tests examples tools/ui
for b in ggml/src/ggml-*/; do
  case $(basename "$b") in ggml-cpu|ggml-cuda) ;; *) [ -f "$b/CMakeLists.txt" ] && rm -rf "$b" ;; esac
done
mkdir -p "$(dirname "$DEST")"
tar cf - -C "$SRC/.." llama.cpp | xz -T0 -6 > "$DEST.tmp" && mv "$DEST.tmp" "$DEST"
ls -la "$DEST"
