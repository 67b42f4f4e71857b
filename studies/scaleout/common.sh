# Sourced by the scale-out scripts (run.sh, routing.sh), which set NS (a Redis namespace of this run)
# and TMP (a scratch folder) first: one-thread processes, the run's namespaces, cleanup of every
# process started (their pids in PIDS) and of the run's Redis keys on exit, a free port, and a wait for
# an API that is ready with a number of live workers.
PY=${PY:-python}
REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/0}
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
    n=$($PY -c "import httpx
try:
    r=httpx.get('$1/ready',timeout=5); print(len(r.json().get('workers',[])) if r.status_code==200 else -1)
except Exception: print(-1)")
    [ "$n" = "$2" ] && return 0
    sleep 1
  done
  echo "not ready: $1" >&2; return 1
}
