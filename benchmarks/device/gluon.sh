#!/bin/bash
# Device run of the Gluon GEMM (issue 17, dynaquant/kernels/gluon_gemm.py; built without a GPU in session 38), cheapest
# and most telling steps first: its native tests (tests/test_gluon_gemm.py: every runtime format against the float32
# reference, K splits, a CUDA graph; the sm_90 compile checks), then kernel_speed.py's decode step at M = 256 and 64
# with the default kernels and with the Gluon kernel forced on the same tiles (--force-gemm gluon, then with the words
# two tiles ahead) and on 256-token tiles, then M = 16 on a 64-token Gluon tile, then the sweep of M = 256 (every
# candidate, the Gluon tiles among them) for INT4_G128. Every kernel_speed run times bf16 in the same run; compare ratios within a run.
# usage: bash benchmarks/device/gluon.sh OUT   (in the foreground with the call's $OUT: what finished comes back)
# Writes OUT/gluon.log, OUT/status, OUT/gluon-tests.txt, OUT/k-*.json, OUT/summary.txt (the step rows).
LOGNAME_=gluon.log
source "$(dirname "$0")/common.sh" "$1"; shift
F=INT4_G128,INT2_G128,MXFP4_G32
steps() {  # the decode step's rows of kernel_speed.py's JSON files, one line each, into summary.txt
  python3 - "$@" >> "$OUT/summary.txt" <<'PY'
import json, sys
for path in sys.argv[1:]:
    try:
        rows = json.load(open(path))
    except (OSError, ValueError) as e:
        print(path, "unreadable:", e); continue
    for r in rows:
        if r.get("row") in ("step", "step_fused"):
            print(path.rsplit("/", 1)[-1], r["row"], r["format"], "M", r["m"], f"{r['speedup_vs_bf16']:.3f}x bf16",
                  f"{r['time_s'] * 1e6:.0f} us")
PY
  tail -n 20 "$OUT/summary.txt"
}
status "gluon: native tests"
# never run on a GPU before: a wrong mbarrier phase would hang, so every step has a time limit, and nothing is timed
# unless the tests pass
if ! timeout 300 python3 -m pytest -q -p no:cacheprovider -x tests/test_gluon_gemm.py > "$OUT/gluon-tests.txt" 2>&1; then
  tail -30 "$OUT/gluon-tests.txt"
  status "FAILED gluon tests (see gluon-tests.txt): nothing timed"
  exit 1
fi
tail -3 "$OUT/gluon-tests.txt"
K="timeout 240 python3 benchmarks/kernel_speed.py --formats $F"
status "gluon: M = 256, 64 default"; $K --m 256,64 --out "$OUT/k-default.json" || status "FAILED default"
status "gluon: M = 256, 64 gluon"; $K --m 256,64 --force-gemm gluon --out "$OUT/k-gluon.json" || status "FAILED gluon"
steps "$OUT/k-default.json" "$OUT/k-gluon.json"
status "gluon: M = 256 gluon, words two tiles ahead; 256-token tiles"
$K --m 256 --force-gemm gluon,prefetch --out "$OUT/k-gluon-pf.json" || status "FAILED gluon prefetch"
$K --m 256 --force-gemm gluon,prefetch,block_m=256,block_k=64,num_stages=4 --out "$OUT/k-gluon256.json" \
  || status "FAILED gluon256"
steps "$OUT/k-gluon-pf.json" "$OUT/k-gluon256.json"
status "gluon: M = 16 default and gluon 64-token tiles"
$K --m 16 --out "$OUT/k16-default.json" || status "FAILED m16 default"
$K --m 16 --force-gemm gluon,block_m=64,num_stages=4 --out "$OUT/k16-gluon.json" || status "FAILED m16 gluon"
steps "$OUT/k16-default.json" "$OUT/k16-gluon.json"
status "gluon: sweep M = 256 INT4_G128"
timeout 300 python3 benchmarks/kernel_speed.py --formats INT4_G128 --m 256 --sweep --sweep-m 256 --sweep-formats INT4_G128 \
  --budget-s 240 --out "$OUT/k-sweep256.json" || status "FAILED sweep"
steps "$OUT/k-sweep256.json"
status "gluon: done"
