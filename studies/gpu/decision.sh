# The context-modes study (studies/context_modes.py) in K processes sharing one GPU, each stopped
# after SECONDS, then joined (studies/context_merge.py) into OUT-none.json and OUT-document.json.
#   bash studies/gpu/decision.sh OUT SEED N SHAPE K SECONDS [TASKS] [METHODS]
# Each process checkpoints after every example and runs the examples I, I+K, ... task by task in turn,
# so a stopped run still has about as many examples of every task.
out=$1; seed=$2; n=$3; shape=$4; k=$5; secs=$6
tasks=${7:-needle,multikey,multivalue}; methods=${8:-anchor,prophetkv,cacheblend,a3}
mkdir -p "$(dirname "$out")"
for i in $(seq 0 $((k - 1))); do
  STUDY_SHARD=$i/$k STUDY_SHAPE=$shape timeout "$secs" python3 studies/context_modes.py document "$seed" "$n" \
    "$out.s$i" "$tasks" "$methods" > "$out.s$i.log" 2>&1 &
done
wait
python3 studies/context_merge.py "$out"
