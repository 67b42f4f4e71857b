#!/bin/sh
# Seed 0 (tuning), the remaining context modes on needle and multikey (one example each: the CPU budget).
OUT=docs/results/fidelity-context
for MODE in neighbours prefix; do
  taskset -c 1 env OMP_NUM_THREADS=1 KVFUSE_MODEL__THREADS=1 python -m kvfuse.cli \
    bench fidelity --task needle,multikey --n 1 --docs 8 --doc-tokens 512 --ratios 0.15 \
    --methods anchor --seed 0 --precompute-context "$MODE" --data-dir ../shared/data \
    --json "$OUT/tune-seed0-$MODE.json"
done
