#!/bin/bash
# Device run for IQ3 on CUDA (issue 16): the native IQ3 tests, one encode's launches by kind (iq3_configs.py
# --breakdown), the default against a round's levels and step 1 each in one launch (--configs
# prefetch32,levels,step1,fused), then encode.sh (every type against llama.cpp in one run, or the types given) with
# the configuration fastest on IQ3_XXS among those that give the default's bytes (--iq3-fused).
# usage: bash benchmarks/device/iq3.sh OUT [encode_speed.py options, e.g. --types IQ3_XXS,IQ3_S]
# Polling-friendly: setsid nohup bash benchmarks/device/iq3.sh /root/dq/iq3-out & ; then read OUT/status.
# Writes OUT/iq3.log, OUT/tests.txt, OUT/breakdown.json, OUT/configs.txt and encode.sh's files.
LOGNAME_=iq3.log
source "$(dirname "$0")/common.sh" "$1"; shift
status "iq3: native tests"
python3 -m pytest -q -p no:cacheprovider tests/test_lattice_search.py -k iq3 > "$OUT/tests.txt" 2>&1 \
  || status "FAILED tests (see tests.txt)"
tail -3 "$OUT/tests.txt"
status "iq3: breakdown"
python3 benchmarks/iq3_configs.py --breakdown > "$OUT/breakdown.json" || status "FAILED breakdown"
status "iq3: configs prefetch32,levels,step1,fused"
python3 benchmarks/iq3_configs.py --configs prefetch32,levels,step1,fused > "$OUT/configs.txt" 2>&1 || status "FAILED configs"
tail -1 "$OUT/configs.txt"
# the fastest of prefetch32 (today's default), levels, step1 and fused on IQ3_XXS runs the encode table
FUSED=$(python3 benchmarks/iq3_configs.py --choose "$OUT/configs.txt" 2>/dev/null || echo none)
status "iq3: encode.sh (--iq3-fused $FUSED)"
bash "$(dirname "$0")/encode.sh" "$OUT" --iq3-fused "$FUSED" "$@"
status "iq3: done"
