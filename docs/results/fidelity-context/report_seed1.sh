#!/bin/sh
# Seed 1 (report), another system prompt than the tuning: anchor, cacheblend and prophetkv at r = 0.15 with
# chunk caches computed alone (none) and after MODE, ~4k tokens (8 chunks x 512), task by task so both modes
# have the same examples whenever the run stops. Run from the repository root on one core:
#   sh docs/results/fidelity-context/report_seed1.sh MODE N
MODE=$1
N=${2:-2}
OUT=docs/results/fidelity-context
for TASK in needle multikey multivalue; do
  for CTX in none "$MODE"; do
    taskset -c 1 env OMP_NUM_THREADS=1 KVFUSE_MODEL__THREADS=1 PYTHONPATH=$PWD \
      KVFUSE_MODEL__SYSTEM_PROMPT='You are a careful reader. Reply with only the answer, taken from the documents.' \
      /work/main/.venv/bin/python -m kvfuse.cli \
      bench fidelity --task "$TASK" --n "$N" --docs 8 --doc-tokens 512 --ratios 0.15 \
      --methods anchor,cacheblend,prophetkv --seed 1 --precompute-context "$CTX" --data-dir /work/shared/data \
      --json "$OUT/seed1-$TASK-$CTX.json"
  done
done
