# The prepared GPU run of docs/results/gpu/README.md ("How to run"): on a bare lent H100 or H200 with
# .whl and .gpu/tok carried (studies/gpu/prepare.sh), from the repository root, in under 8 minutes:
# the CUDA tests (attention paths, low precision, layer loader), then `kvfuse bench gpu` at 8k and 32k,
# vanilla and the default `anchor` at r = 0.15, KV from page-locked RAM, already on the device, and from
# LMDB, anchor's recompute also through the dense mask, decode at 1 and 32 streams; then `kvfuse bench
# store` read GB/s against threads (store-threads.json); the short table last.
#   bash studies/gpu/targets.sh OUTDIR
out=${1:?OUTDIR}
export TEST_TIMEOUT=${TEST_TIMEOUT:-170} BENCH_TIMEOUT=${BENCH_TIMEOUT:-250}
bash studies/gpu/bench.sh "$out" --contexts 8192,32768 --methods anchor --repeats 2 --decode-tokens 32 \
  --streams 1,32 --stream-steps 32 --profile-context 32768 > "$out.console.txt" 2>&1
status=$?
mkdir -p "$out" && mv "$out.console.txt" "$out/console.txt"
# store reads against threads on a host with cores to spare (docs/results/store/README.md)
export PYTHONPATH=/tmp/site:$PWD
timeout 60 python3 -m kvfuse.cli bench store --json --no-progress --chunks 32 --tokens 512 --dtypes bfloat16 \
  --threads 1,2,4,8 --repeats 2 --dir /tmp > "$out/store-threads.json" 2> "$out/store-threads.log"
grep -E "passed|failed|error" "$out/cuda-tests.txt" | tail -3
# the short table: the bench prints it last
awk '/^\| context \| method \| TTFT s \| × vanilla \(RAM\)/{p=1} p' "$out/bench.log"
exit $status
