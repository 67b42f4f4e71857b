# The prepared GPU run of docs/results/gpu/README.md ("How to run"): on a bare lent H100 or H200 with
# .whl and .gpu/tok carried (studies/gpu/prepare.sh), from the repository root, in under 7 minutes and
# 8 files: the CUDA tests (attention paths, low precision, the engine runner's CUDA graphs, the device
# tier), then `kvfuse bench gpu` at 8k and 32k, vanilla and the default `anchor` at r = 0.15, KV from
# page-locked RAM, already on the device, and from LMDB, anchor's recompute also through the dense mask,
# the engine core's decode (its KV memory, runner and CUDA graphs) at 1 and 32 streams right after the
# first context; then `kvfuse bench store` read GB/s against threads; the short table last.
# Without CUDA the same steps run on the CPU with the tiny shape, in under 3 minutes (tests/bench/
# test_gpu_targets.py runs it so, so the script cannot rot between lent machines).
#   bash studies/gpu/targets.sh OUTDIR
out=${1:?OUTDIR}
mkdir -p "$out"
. studies/gpu/python.sh || exit 1
if [ -n "$KVFUSE_GPU" ]; then
  args=(--contexts 8192,32768 --methods anchor --repeats 2 --decode-tokens 32 --streams 1,32 --stream-steps 32)
  store=(--chunks 32 --tokens 512 --threads 1,2,4,8 --repeats 2)
else
  export TEST_TIMEOUT=${TEST_TIMEOUT:-60} BENCH_TIMEOUT=${BENCH_TIMEOUT:-90}
  args=(--shape tiny --device cpu --dtype float32 --contexts 512,1024 --methods anchor --repeats 1
        --decode-tokens 4 --streams 1,4 --stream-steps 4)
  store=(--chunks 8 --tokens 128 --threads 1,2 --repeats 1)
fi
bash studies/gpu/bench.sh "$out" "${args[@]}" > "$out/console.txt" 2>&1
status=$?
# store reads against threads (docs/results/store/README.md); its log goes to the console file
timeout 40 $py -m kvfuse.cli bench store --json --no-progress --dtypes bfloat16 "${store[@]}" --dir /tmp \
  > "$out/store-threads.json" 2>> "$out/console.txt"
grep -E "passed|failed|error|skipped" "$out/cuda-tests.txt" | tail -3
# the short table: the bench prints it last
awk '/^\| context \| method \| TTFT s \| × vanilla \(RAM\)/{p=1} p' "$out/bench.log"
exit $status
