#!/bin/bash
# Device run of GPTQ's block kernel (issue 16): its native tests (bytes against the torch loop, the whole GPTQ), then
# benchmarks/gptq_speed.py (the torch column loop against the kernel on Llama-3-8B's shapes, per K-quant type).
# usage: bash benchmarks/device/gptq.sh OUT [gptq_speed.py options, e.g. --formats Q4_K,Q6_K --repeats 3]
# Writes OUT/gptq.log, OUT/gptq-tests.log, OUT/gptq_speed.json (rewritten after every row); OUT/status one line a
# step. One device call (< 10 minutes with the defaults): nothing is left for a later call to pick up.
LOGNAME_=gptq.log
source "$(dirname "$0")/common.sh" "$1"; shift
status "gptq: native tests"
python3 -m pytest -q -p no:cacheprovider tests/test_gptq_block.py tests/test_gptq_speed_bench.py > "$OUT/gptq-tests.log" 2>&1 \
  || status "FAILED: native tests (OUT/gptq-tests.log)"
tail -3 "$OUT/gptq-tests.log"
status "gptq: benchmark"
python3 benchmarks/gptq_speed.py --out "$OUT/gptq_speed.json" "$@" || status "FAILED: gptq_speed"
status "gptq: done"
