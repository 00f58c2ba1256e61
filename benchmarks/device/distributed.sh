#!/bin/bash
# Device run of the distributed pipeline (issues 20 and 21): benchmarks/scale.py with --nproc on the GPUs.
# usage: bash benchmarks/device/distributed.sh OUT [scale.py options; default: the identity check alone]
#   1. identity on the GPU: tiny-deepseek (MoE + MLA), --gptq and one measured correction: one process, torchrun with
#      one rank (NCCL's path on one GPU) and with every GPU of the machine: OUT/identity.json (same_bytes);
#      (SKIP_IDENTITY=1: not run);
#   2. with options: scale.py OPTIONS (e.g. --shape llama-8b --blocks 32 --nproc 1,2): OUT/scale.json, and with
#      GPTQ_TOO=1 the same with --gptq: OUT/scale-gptq.json.
# Polling-friendly, as scale.sh: setsid nohup bash benchmarks/device/distributed.sh /root/dq/dist-out ... &
LOGNAME_=distributed.log
WORK=${WORK:-/root/dq/dist}
source "$(dirname "$0")/common.sh" "$1"; shift
TOK=${TOKENIZER:-$REPO/.dev/smollm2-tokenizer}
TOKARG=(); [ -e "$TOK" ] && TOKARG=(--tokenizer "$TOK")
NGPU=$(nvidia-smi -L | wc -l)
[ -n "${SKIP_IDENTITY:-}" ] || { status "identity: tiny-deepseek, 1 process / torchrun 1 rank / torchrun $NGPU ranks"
python3 benchmarks/scale.py --work "$WORK/identity" --out "$OUT/identity.json" "${TOKARG[@]}" --shape tiny-deepseek \
  --blocks 4 --nproc "1,1t,$NGPU" --bpw 6.5 --calibration-chunks 8 --ctx 128 --gptq --correct 1 \
  || status "FAILED identity"; }
if [ $# -gt 0 ]; then
  status "scale.py $*"
  python3 benchmarks/scale.py --work "$WORK/scale" --out "$OUT/scale.json" "${TOKARG[@]}" "$@" || status "FAILED"
fi
[ -z "${GPTQ_TOO:-}" ] || { status "scale.py $* --gptq"
  python3 benchmarks/scale.py --work "$WORK/scale" --out "$OUT/scale-gptq.json" "${TOKARG[@]}" "$@" --gptq \
    || status "FAILED gptq"; }
status "done"
