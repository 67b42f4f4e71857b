#!/usr/bin/env bash
# The same answers and the same load figures before and after a restructuring: the fidelity benchmark and
# the load benchmark, each tree in turn, on one core with one torch thread (the other core stays free for
# other work). Usage: studies/house/before_after.sh OLD_TREE NEW_TREE OUT_DIR
# Each tree runs its own code (PYTHONPATH) with this checkout's virtual environment and model cache.
set -euo pipefail
OLD=$(realpath "$1"); NEW=$(realpath "$2"); OUT=$(realpath -m "$3")
HERE=$(cd "$(dirname "$0")/../.." && pwd)
PY="$HERE/.venv/bin/python"
DATA=$(realpath "$HERE/../shared/data")
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 KVFUSE_MODEL__THREADS=1 KVFUSE_MODEL_CACHE_DIR="$HERE/data/models" KVFUSE_LOG_LEVEL=warning
run() {  # tree label args...
  local tree=$1 label=$2; shift 2
  echo "== $label: $* ($(date -u +%H:%M:%S))"
  (cd "$tree" && PYTHONPATH="$tree" taskset -c 0 "$PY" -m kvfuse.cli bench "$@")
}
for round in 1 2; do
  for side in old new; do
    tree=$OLD; [ "$side" = new ] && tree=$NEW
    run "$tree" "load-$side-$round" load --concurrency 1,4 --rounds 2 --methods anchor --context-tokens 4096 \
      --docs 4 --max-tokens 32 --seed 0 --data-dir "$DATA" --json "$OUT/load-$side-$round.json"
  done
done
for side in old new; do
  tree=$OLD; [ "$side" = new ] && tree=$NEW
  run "$tree" "fidelity-$side" fidelity --n 4 --task needle,multikey --docs 4 --ratios 0.15 --seed 0 \
    --data-dir "$DATA" --json "$OUT/fidelity-$side.json"
done
