# Sourced by encode.sh and pipeline.sh with the output folder as $1 and the log's name as $LOGNAME_:
# OUT, REPO, WORK (default /root/dq/pipe), output to OUT/$LOGNAME_, status() lines to OUT/status,
# the checkout on PYTHONPATH, the gguf package (GGUF_WHEEL, default .dev/gguf-0.19.0-py3-none-any.whl) installed.
set -uo pipefail
OUT=$(realpath -m "$1")
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
WORK=${WORK:-/root/dq/pipe}
mkdir -p "$OUT" "$WORK"
exec >> "$OUT/$LOGNAME_" 2>&1
status() { echo "$(date +%T) $*" >> "$OUT/status"; echo "=== $(date +%T) $*"; }
cd "$REPO" || exit 1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
status "start $LOGNAME_: $(nproc) cores, $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
python3 -c "import gguf" 2>/dev/null || python3 -m pip install -q --no-deps "${GGUF_WHEEL:-$REPO/.dev/gguf-0.19.0-py3-none-any.whl}"
