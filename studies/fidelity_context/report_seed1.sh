#!/bin/sh
# Seed 1 (report), another system prompt than the tuning: anchor, cacheblend and prophetkv at r = 0.15 with
# chunk caches computed alone (none) and after MODE on the same examples, plus anchor without its forced
# chunk-start tokens under MODE; ~4k tokens (8 chunks x 512). Run from the repository root on one core:
#   sh studies/fidelity_context/report_seed1.sh MODE N
MODE=$1
N=${2:-2}
taskset -c 1 env OMP_NUM_THREADS=1 KVFUSE_MODEL__THREADS=1 PYTHONPATH=$PWD KVFUSE_BENCH__DATA_DIR=../shared/data \
  KVFUSE_MODEL__SYSTEM_PROMPT='You are a careful reader. Reply with only the answer, taken from the documents.' \
  python studies/context_modes.py "$MODE" 1 "$N" docs/results/fidelity-context/seed1
