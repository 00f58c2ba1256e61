#!/bin/bash
# Device run of benchmarks/scale.py (issue 15): quantize --stream on random checkpoints of real shapes cut to a few
# blocks (made on the GPU), peak RSS and GPU memory, the full models extrapolated per block.
# usage: bash benchmarks/device/scale.sh OUT [scale.py options; default: 1B and 8B whole, 70B and DeepSeek-V3 cuts]
# env:   WORK (default /root/dq/scale: checkpoints, removed after each run), TOKENIZER (default .dev/smollm2-tokenizer
#        if there, else the default model's GGUF), GGUF_WHEEL (as common.sh)
# Polling-friendly, as pipeline.sh: setsid nohup bash benchmarks/device/scale.sh /root/dq/scale-out > /dev/null 2>&1 &
#   then OUT/status, OUT/scale.log, OUT/scale*.json (rows rewritten after each run). The disk (64 GB) holds one
#   checkpoint at a time: a DeepSeek-V3 cut of 4 blocks is ~20 GB in FP8 (~40 GB in BF16 while it is made).
LOGNAME_=scale.log
WORK=${WORK:-/root/dq/scale}
source "$(dirname "$0")/common.sh" "$1"; shift
TOK=${TOKENIZER:-$REPO/.dev/smollm2-tokenizer}
TOKARG=(); [ -e "$TOK" ] && TOKARG=(--tokenizer "$TOK")
if [ $# -gt 0 ]; then
  status "scale.py $*"
  python3 benchmarks/scale.py --work "$WORK" --out "$OUT/scale.json" "${TOKARG[@]}" "$@" && status "done" || status "FAILED"
  exit 0
fi
status "llama-1b and llama-8b, whole"
python3 benchmarks/scale.py --work "$WORK" --out "$OUT/scale-1b.json" "${TOKARG[@]}" --shape llama-1b --blocks 16 \
  || status "FAILED llama-1b"
python3 benchmarks/scale.py --work "$WORK" --out "$OUT/scale-8b.json" "${TOKARG[@]}" --shape llama-8b --blocks 32 \
  || status "FAILED llama-8b"
status "llama-70b: 2 and 4 blocks"
python3 benchmarks/scale.py --work "$WORK" --out "$OUT/scale-70b.json" "${TOKARG[@]}" --shape llama-70b --blocks 2,4 \
  || status "FAILED llama-70b"
status "deepseek-v3: 4 and 5 blocks (3 dense, then MoE)"
python3 benchmarks/scale.py --work "$WORK" --out "$OUT/scale-deepseek.json" "${TOKARG[@]}" --shape deepseek-v3 \
  --blocks 4,5 || status "FAILED deepseek-v3"
status "done"
