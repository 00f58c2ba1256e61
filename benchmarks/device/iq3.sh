#!/bin/bash
# Device run for IQ3 on CUDA (issue 16), cheapest and most telling steps first: the default against a round's levels
# and step 1 each in one launch (iq3_configs.py --configs prefetch32,fused,levels,step1; IQ3_XXS before IQ3_S, lines
# flushed as they finish), then encode.sh (every type against llama.cpp in one run, or the types given) with the
# configuration fastest on IQ3_XXS among those that give the default's bytes (--iq3-fused), then the native IQ3
# tests, then one encode's launches by kind (iq3_configs.py --breakdown).
# usage: bash benchmarks/device/iq3.sh OUT [encode_speed.py options, e.g. --types IQ3_XXS,IQ3_S]
# Polling-friendly: setsid nohup bash benchmarks/device/iq3.sh /root/dq/iq3-out & ; then read OUT/status.
# For a short lease run it in the foreground with the call's own output folder, `bash benchmarks/device/iq3.sh "$OUT"
# --types IQ3_XXS,IQ3_S` (carry .dev/gguf-0.19.0-py3-none-any.whl and .dev/llama-src.tar.xz): what finished comes back
# even if the call runs past its limit.
# Writes OUT/iq3.log, OUT/status, OUT/configs.txt, encode.sh's files, OUT/tests.txt, OUT/breakdown.json.
LOGNAME_=iq3.log
source "$(dirname "$0")/common.sh" "$1"; shift
status "iq3: configs prefetch32,fused,levels,step1"
python3 benchmarks/iq3_configs.py --configs prefetch32,fused,levels,step1 > "$OUT/configs.txt" 2>&1 || status "FAILED configs"
tail -1 "$OUT/configs.txt"
FUSED=$(python3 benchmarks/iq3_configs.py --choose "$OUT/configs.txt" 2>/dev/null || echo none)
status "iq3: encode.sh (--iq3-fused $FUSED)"
bash "$(dirname "$0")/encode.sh" "$OUT" --iq3-fused "$FUSED" "$@"
status "iq3: native tests"
python3 -m pytest -q -p no:cacheprovider tests/test_lattice_search.py -k iq3 > "$OUT/tests.txt" 2>&1 \
  || status "FAILED tests (see tests.txt)"
tail -3 "$OUT/tests.txt"
status "iq3: breakdown"
python3 benchmarks/iq3_configs.py --breakdown > "$OUT/breakdown.json" || status "FAILED breakdown"
status "iq3: done"
