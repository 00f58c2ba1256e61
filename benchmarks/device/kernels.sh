#!/bin/bash
# Device run of issue 17's three tables, one polled job: kernel_speed.py (INT4_G128, INT2_G128, MXFP4_G32 at M = 1,
# 16, 256 against bf16 in the same run), moe_kernels.py (the two MoE shapes, M = 1, 16, 256), decode.py (bf16, INT4,
# INT2; batch 1 and 16; eager graphs and torch.compile), then the native kernel tests.
# usage: bash benchmarks/device/kernels.sh OUT [STEPS]   STEPS: a comma list of kernels,moe,decode,tests (default all)
# Polling-friendly: setsid nohup bash benchmarks/device/kernels.sh /root/dq/k-out & ; then read OUT/status.
# Writes OUT/kernels.log, OUT/kernels.json, OUT/moe_kernels.json, OUT/decode.json, OUT/kernel-tests.txt.
LOGNAME_=kernels.log
source "$(dirname "$0")/common.sh" "$1"; shift
STEPS=",${1:-kernels,moe,decode,tests},"
if [[ $STEPS == *,kernels,* ]]; then
  status "kernel_speed.py"
  python3 benchmarks/kernel_speed.py --formats INT4_G128,INT2_G128,MXFP4_G32 --m 1,16,256 --out "$OUT/kernels.json" \
    || status "FAILED kernel_speed"
fi
if [[ $STEPS == *,moe,* ]]; then
  status "moe_kernels.py"
  python3 benchmarks/moe_kernels.py --out "$OUT/moe_kernels.json" || status "FAILED moe_kernels"
fi
if [[ $STEPS == *,decode,* ]]; then
  status "decode.py"
  python3 benchmarks/decode.py --plans bf16,INT4_G128,INT2_G128 --compile both --profile --out "$OUT/decode.json" \
    || status "FAILED decode"
fi
if [[ $STEPS == *,tests,* ]]; then
  status "native kernel tests"
  python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernels_resident.py > "$OUT/kernel-tests.txt" 2>&1 \
    || status "FAILED kernel tests (see kernel-tests.txt)"
  tail -3 "$OUT/kernel-tests.txt"
fi
status "kernels: done"
