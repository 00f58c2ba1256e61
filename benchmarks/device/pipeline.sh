#!/bin/bash
# Device run of benchmarks/pipeline_speed.py (issue 16): llama.cpp's tools built with CUDA (sm_90) in a setsid
# background job while the Llama-3-8B-shaped checkpoint is made on the GPU, then every pipeline side by side.
# usage: bash benchmarks/device/pipeline.sh OUT [pipeline_speed.py options, e.g. --modes bpw4.5,gptq]
# env:   WORK (default /root/dq/pipe: checkpoint, llama.cpp tree and builds, GGUFs; kept for a second call),
#        LLAMA_SRC_TAR (default .dev/llama-src.tar.xz), GGUF_WHEEL (default .dev/gguf-0.19.0-py3-none-any.whl),
#        TOKENIZER (default .dev/smollm2-tokenizer if there, else the default model's GGUF), JOBS (default nproc - 2),
#        LLAMA_BIN_PACK (default .dev/llama-cuda-bin.tar.xz: the parts .00, .01, ... written by llama_pack.sh in an
#        earlier call; when there, the source tree and those tools are unpacked instead of built)
# Polling-friendly: run it in the background and read OUT/status (one line a step), OUT/pipeline.log (everything),
# OUT/pipeline_speed.json (rows, rewritten after every step), OUT/summary.md at the end:
#   setsid nohup bash benchmarks/device/pipeline.sh /root/dq/pipe-out > /dev/null 2>&1 < /dev/null &
#   cat /root/dq/pipe-out/status; tail -3 /root/dq/pipe-out/pipeline.log
# A second call with the same WORK and OUT keeps the rows and files already made (--resume): the checkpoint, the
# BF16 GGUF and the imatrix are not made again (e.g. a later call with --modes bpw2.5 for the IQ2_XS anchor).
LOGNAME_=pipeline.log
source "$(dirname "$0")/common.sh" "$1"; shift
TOK=${TOKENIZER:-$REPO/.dev/smollm2-tokenizer}
TOKARG=(); [ -e "$TOK" ] && TOKARG=(--tokenizer "$TOK")
BIN=$WORK/llama.cpp/build-cuda/bin; NGL=99
PACK=${LLAMA_BIN_PACK:-$REPO/.dev/llama-cuda-bin.tar.xz}
if [ ! -x "$BIN/llama-quantize" ] && [ -f "$PACK.00" ]; then
  status "unpacking llama.cpp's source and the CUDA tools of an earlier call ($PACK.*)"
  tar xJf "${LLAMA_SRC_TAR:-$REPO/.dev/llama-src.tar.xz}" -C "$WORK" && cat "$PACK".* | xz -d | tar xf - -C "$WORK/llama.cpp" \
    || status "unpacking failed: building instead"
  export LD_LIBRARY_PATH="$BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if [ ! -x "$BIN/llama-quantize" ] || [ ! -x "$BIN/llama-imatrix" ]; then
  if [ -f "$WORK/build-cuda.pid" ] && kill -0 "$(cat "$WORK/build-cuda.pid")" 2>/dev/null; then
    status "llama.cpp CUDA build of an earlier call still running: waiting for it"
  else
    rm -f "$WORK/build-cuda.ok" "$WORK/build-cuda.failed"
    setsid bash benchmarks/device/llama_build.sh "$WORK" cuda "$OUT/build-cuda.log" < /dev/null > /dev/null 2>&1 &
    echo $! > "$WORK/build-cuda.pid"
    status "llama.cpp CUDA build started in the background (pid $!, log OUT/build-cuda.log)"
  fi
fi
status "checkpoint"
python3 benchmarks/pipeline_speed.py --work "$WORK" --out "$OUT/pipeline_speed.json" --resume --make-only "${TOKARG[@]}" "$@" \
  || { status "FAILED: checkpoint"; exit 1; }
status "checkpoint done; waiting for the llama.cpp build"
while [ ! -x "$BIN/llama-quantize" ] || [ ! -x "$BIN/llama-imatrix" ]; do
  if [ -e "$WORK/build-cuda.failed" ]; then
    status "CUDA build failed (OUT/build-cuda.log): CPU tools instead, llama-imatrix on the CPU (-ngl 0)"
    bash benchmarks/device/llama_build.sh "$WORK" cpu "$OUT/build-cpu.log" || { status "FAILED: CPU build too"; break; }
    BIN=$WORK/llama.cpp/build-cpu/bin; NGL=0; break
  fi
  sleep 5
done
status "benchmark (llama-bin $BIN)"
python3 benchmarks/pipeline_speed.py --work "$WORK" --out "$OUT/pipeline_speed.json" --resume "${TOKARG[@]}" \
  --llama-src "$WORK/llama.cpp" --llama-bin "$BIN" --ngl "$NGL" --threads "$(nproc)" "$@" || status "FAILED: benchmark"
python3 benchmarks/pipeline_speed.py --summary --out "$OUT/pipeline_speed.json" > "$OUT/summary.md"
status "done"
