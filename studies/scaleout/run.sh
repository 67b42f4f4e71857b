#!/usr/bin/env bash
# The scale-out load figure: `kvfuse bench load --url` against one API with, in turn, the embedded worker,
# a fleet of 1 `kvfuse worker` and a fleet of 2, every process on the cores this script is given
# (run it under `taskset`). Results: docs/results/scaleout/. Needs Redis at $REDIS_URL.
#   taskset -c 0 bash studies/scaleout/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-python}
REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/0}
NS="kvfuse-scaleout-$$"
TMP=$(mktemp -d /tmp/kvfuse-scaleout.XXXX)
OUT=docs/results/scaleout
LOAD=(--concurrency 1,4 --rounds 2 --methods anchor --context-tokens 1024 --docs 2 --max-tokens 32 --seed 0
      --data-dir "${KVFUSE_BENCH__DATA_DIR:-../shared/data}")
export OMP_NUM_THREADS=1 KVFUSE_MODEL__THREADS=1 KVFUSE_LOG_LEVEL=warning KVFUSE_FLEET__NAMESPACE="$NS:fleet"
export KVFUSE_STORE__REDIS_NAMESPACE="$NS" KVFUSE_MODEL_CACHE_DIR="${KVFUSE_MODEL_CACHE_DIR:-$PWD/data/models}"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  $PY - "$REDIS_URL" "$NS" <<'PYEOF'
import sys, redis
r = redis.Redis.from_url(sys.argv[1])
keys = list(r.scan_iter(match=f"{sys.argv[2]}:*", count=1000))
if keys:
    r.delete(*keys)
PYEOF
  rm -rf "$TMP"
}
trap cleanup EXIT
port() { $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_ready() {  # url, live workers wanted
  for _ in $(seq 600); do
    n=$($PY -c "import httpx,sys
try:
    r=httpx.get('$1/ready',timeout=5); print(len(r.json().get('workers',[])) if r.status_code==200 else -1)
except Exception: print(-1)")
    [ "$n" = "$2" ] && return 0
    sleep 1
  done
  echo "not ready: $1" >&2; return 1
}
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
