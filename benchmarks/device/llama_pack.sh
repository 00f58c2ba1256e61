#!/bin/bash
# Pack llama.cpp's CUDA tools built by `SHARED=ON llama_build.sh WORK cuda LOG` for a later device call: a device
# machine is given back ~30 s after a call, so a build must come back through $OUT to be reused (no call has time
# for the build and both pipelines). Writes DEST.00, DEST.01, ... (xz, split under 15 MiB: $OUT's per-file limit);
# copy them into the checkout's .dev/ and carry .dev. pipeline.sh unpacks them (LLAMA_BIN_PACK) instead of building.
# usage: bash benchmarks/device/llama_pack.sh WORK DEST      (e.g. /root/dq/pipe $OUT/llama-cuda-bin.tar.xz)
set -euo pipefail
WORK=$1; DEST=$2
cd "$WORK/llama.cpp"
B=build-cuda/bin
# the shared libraries, wherever CMake put them, go beside the tools (pipeline.sh puts that folder on LD_LIBRARY_PATH)
find build-cuda -name 'lib*.so*' -not -path '*/CMakeFiles/*' -not -path "$B/*" -exec cp -a {} "$B/" \;
FILES=("$B"/llama-imatrix "$B"/llama-quantize build-cuda/CMakeCache.txt)
for f in "$B"/lib*.so*; do FILES+=("$f"); done
ls -la "${FILES[@]}"
tar cf - "${FILES[@]}" | xz -T0 -6 | split -b 15M -d - "$DEST."
ls -la "$DEST".*
