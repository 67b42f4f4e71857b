#!/bin/sh
# Seed 0 (tuning): anchor at r = 0.15 under each precompute context, ~4k tokens (8 chunks x 512).
# Run from the repository root on one core: sh studies/fidelity_context/tune_seed0.sh N
N=${1:-1}
OUT=docs/results/fidelity-context
for MODE in none document neighbours prefix; do
  taskset -c 1 env OMP_NUM_THREADS=1 KVFUSE_MODEL__THREADS=1 python -m kvfuse.cli \
    bench fidelity --task needle,multikey,multivalue --n "$N" --docs 8 --doc-tokens 512 --ratios 0.15 \
    --methods anchor --seed 0 --precompute-context "$MODE" --data-dir ../shared/data \
    --json "$OUT/tune-seed0-$MODE.json"
done
