#!/bin/bash
# Device run for IQ3 on CUDA (issue 16) for a short lease: run in the foreground with OUT=$OUT, so that whatever the
# steps wrote comes back even if the call runs past its limit. Cheapest and most telling first: the configurations
# (prefetch32 = today's default, fused, levels, step1; IQ3_XXS before IQ3_S, lines flushed as they finish), then
# encode.sh for IQ3_XXS and IQ3_S against llama.cpp with the fastest configuration that gives the default's bytes
# (--iq3-fused), then the native IQ3 tests. benchmarks/device/iq3.sh is the full job (breakdown included).
# usage: bash benchmarks/device/iq3_quick.sh "$OUT"      (carry .dev/gguf-0.19.0-py3-none-any.whl, .dev/llama-src.tar.xz)
# Writes OUT/iq3q.log, OUT/status, OUT/configs.txt, encode.sh's OUT/encode.log, OUT/encode_speed.json,
# OUT/encode_summary.md (and OUT/build-ggml.log), OUT/tests.txt: at most 8 files.
LOGNAME_=iq3q.log
source "$(dirname "$0")/common.sh" "$1"; shift
status "iq3_quick: configs prefetch32,fused,levels,step1"
python3 benchmarks/iq3_configs.py --configs prefetch32,fused,levels,step1 > "$OUT/configs.txt" 2>&1 || status "FAILED configs"
FUSED=$(python3 benchmarks/iq3_configs.py --choose "$OUT/configs.txt" 2>/dev/null || echo none)
status "iq3_quick: encode.sh --types IQ3_XXS,IQ3_S --iq3-fused $FUSED"
bash "$(dirname "$0")/encode.sh" "$OUT" --types IQ3_XXS,IQ3_S --iq3-fused "$FUSED" "$@"
status "iq3_quick: native tests"
python3 -m pytest -q -p no:cacheprovider tests/test_lattice_search.py -k iq3 > "$OUT/tests.txt" 2>&1 \
  || status "FAILED tests (see tests.txt)"
status "iq3_quick: done"
