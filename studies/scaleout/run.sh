#!/usr/bin/env bash
# The scale-out load figure: `kvfuse bench load --url` against one API with, in turn, the embedded worker,
# a fleet of 1 `kvfuse worker` and a fleet of 2, every process on the cores this script is given
# (run it under `taskset`). Results: docs/results/scaleout/. Needs Redis at $REDIS_URL.
#   taskset -c 0 bash studies/scaleout/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
NS="kvfuse-scaleout-$$"
TMP=$(mktemp -d /tmp/kvfuse-scaleout.XXXX)
OUT=docs/results/scaleout
source studies/scaleout/common.sh
LOAD=(--concurrency 1,4 --rounds 2 --methods anchor --context-tokens 1024 --docs 2 --max-tokens 32 --seed 0
      --data-dir "${KVFUSE_BENCH__DATA_DIR:-../shared/data}")
serve() {  # data dir, extra env... ; sets URL (not in a subshell: the pid must reach PIDS)
  local p; p=$(port)
  env KVFUSE_DATA_DIR="$1" KVFUSE_SERVER__PORT="$p" "${@:2}" $PY -m kvfuse.cli serve >"$1.log" 2>&1 &
  PIDS+=($!)
  URL="http://127.0.0.1:$p"
}
worker() {  # name
  env KVFUSE_DATA_DIR="$TMP/worker-$1" KVFUSE_REDIS_URL="$REDIS_URL" $PY -m kvfuse.cli worker --name "$1" \
    >"$TMP/worker-$1.log" 2>&1 &
  PIDS+=($!)
}
mkdir -p "$OUT"

echo "== embedded (local worker process, no Redis)" >&2
serve "$TMP/embedded"
wait_ready "$URL" 1
$PY -m kvfuse.cli bench load --url "$URL" "${LOAD[@]}" --json "$OUT/load-embedded.json"
kill "${PIDS[0]}"; wait "${PIDS[0]}" 2>/dev/null || true; PIDS=()

echo "== fleet, 1 worker" >&2
worker a
serve "$TMP/api" KVFUSE_REDIS_URL="$REDIS_URL" KVFUSE_SERVER__WORKERS=0
wait_ready "$URL" 1
$PY -m kvfuse.cli bench load --url "$URL" "${LOAD[@]}" --json "$OUT/load-fleet-1worker.json"

echo "== fleet, 2 workers" >&2
worker b
wait_ready "$URL" 2
$PY -m kvfuse.cli bench load --url "$URL" "${LOAD[@]}" --json "$OUT/load-fleet-2workers.json"
$PY - "$URL" > "$OUT/workers-after.json" <<'PYEOF'
import httpx, json, sys
print(json.dumps(httpx.get(sys.argv[1] + "/ready").json()["workers"], indent=1))
PYEOF
