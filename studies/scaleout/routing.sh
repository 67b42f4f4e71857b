#!/usr/bin/env bash
# Query routing in a fleet of two `kvfuse worker`s: locality alone (fleet.route_load_weight 0, how the
# fleet routed before load counted) against the default score, measured with `kvfuse bench load --url`
# in one run, on the same workers and documents. Worker a computes every chunk; before each pair of
# measurements b joins afresh (empty data dir, no chunk held: the case where locality alone sends every
# query to a); the two API runs of a pair differ only in the routing weight. Pairs (labels in $PAIRS)
# repeat the comparison, so that a drift of the machine's other load shows as a spread rather than as a
# difference.
# Results: docs/results/scaleout/ (load-routing-{locality,score}-<pair>.json/md/png).
# Needs Redis at $REDIS_URL. Run from the repository root:  bash studies/scaleout/routing.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PAIRS=${PAIRS:-"1 2"}  # labels of the pairs to run (a later run continues the numbering)
NS="kvfuse-routing-$$"
TMP=$(mktemp -d /tmp/kvfuse-routing.XXXX)
OUT=docs/results/scaleout
LOAD=(--concurrency 1,6 --rounds 2 --methods anchor --context-tokens 1536 --docs 3 --max-tokens 32 --seed 0
      --data-dir "${KVFUSE_BENCH__DATA_DIR:-../shared/data}")
source studies/scaleout/common.sh
API=
api() {  # route_load_weight; sets URL and API (the same data dir each time: the documents stay)
  local p; p=$(port)
  env KVFUSE_DATA_DIR="$TMP/api" KVFUSE_SERVER__PORT="$p" KVFUSE_REDIS_URL="$REDIS_URL" KVFUSE_SERVER__WORKERS=0 \
    KVFUSE_FLEET__ROUTE_LOAD_WEIGHT="$1" $PY -m kvfuse.cli serve >>"$TMP/api.log" 2>&1 &
  API=$!
  PIDS+=("$API")
  URL="http://127.0.0.1:$p"
}
WORKER=
worker() {  # name, data dir; sets WORKER
  env KVFUSE_DATA_DIR="$2" KVFUSE_REDIS_URL="$REDIS_URL" $PY -m kvfuse.cli worker --name "$1" \
    >>"$TMP/worker-$1.log" 2>&1 &
  WORKER=$!
  PIDS+=("$WORKER")
}
mkdir -p "$OUT"

echo "== worker a alone computes every chunk" >&2
worker a "$TMP/worker-a"
api 0
wait_ready "$URL" 1
$PY -m kvfuse.cli bench load --url "$URL" "${LOAD[@]}" --concurrency 1 --rounds 1 --json "$TMP/ingest.json" >/dev/null
DEFAULT=$($PY -c 'from kvfuse.config import FleetSettings; print(FleetSettings().route_load_weight)')
B=
for pair in $PAIRS; do
  echo "== pair $pair: b joins holding nothing" >&2
  if [ -n "$B" ]; then kill "$B"; wait "$B" 2>/dev/null || true; fi
  rm -rf "$TMP/worker-b"
  $PY -c "import redis, sys; redis.Redis.from_url(sys.argv[1]).delete(sys.argv[2])" "$REDIS_URL" "$NS:fleet:holds:b"
  worker b "$TMP/worker-b"
  B=$WORKER
  for policy in locality score; do
    kill "$API"; wait "$API" 2>/dev/null || true
    if [ "$policy" = locality ]; then api 0; else api "$DEFAULT"; fi
    wait_ready "$URL" 2
    echo "== pair $pair: $policy" >&2
    $PY -m kvfuse.cli bench load --url "$URL" "${LOAD[@]}" --json "$OUT/load-routing-$policy-$pair.json"
  done
done
