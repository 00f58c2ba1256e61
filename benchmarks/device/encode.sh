#!/bin/bash
# Device run of benchmarks/encode_speed.py (issue 16): llama.cpp's libggml-base built shared from the carried source
# (CPU, native; seconds), then every type, ours on the GPU against ggml_quantize_chunk on every CPU thread.
# usage: bash benchmarks/device/encode.sh OUT [encode_speed.py options, e.g. --types gguf --cpu-seconds 1]
# env:   WORK (default /root/dq/pipe; shares the llama.cpp tree with pipeline.sh), LLAMA_SRC_TAR, GGUF_WHEEL
# Writes OUT/encode.log, OUT/encode_speed.json (rewritten after every type; a second call resumes) and
# OUT/encode_summary.md; OUT/status gets one line a step.
LOGNAME_=encode.log
source "$(dirname "$0")/common.sh" "$1"; shift
LIB=$(ls "$WORK"/llama.cpp/build-ggml/bin/libggml-base.so 2>/dev/null | head -1)
if [ -z "$LIB" ]; then
  status "encode: building libggml-base"
  bash benchmarks/device/llama_build.sh "$WORK" ggml "$OUT/build-ggml.log" || { status "FAILED: libggml-base build"; exit 1; }
  LIB=$(find "$WORK/llama.cpp/build-ggml" -name 'libggml-base.so' | head -1)
fi
status "encode: running (libggml $LIB)"
python3 benchmarks/encode_speed.py --libggml "$LIB" --cpu-threads "$(nproc)" --cpu-seconds 1 --resume \
  --out "$OUT/encode_speed.json" "$@" || status "FAILED: encode_speed"
python3 benchmarks/encode_speed.py --summary --out "$OUT/encode_speed.json" > "$OUT/encode_summary.md"
status "encode: done"
