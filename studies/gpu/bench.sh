# `kvfuse bench gpu` and the CUDA half of the tests on a GPU host that reaches no package index or model
# hub, from the repository root. Carried: the wheels the image lacks (.whl) and the default model's
# tokenizer and config (.gpu/tok). The tests' model cache gets the default model's shape with random
# weights (the CUDA tests that need its real answers run on a host that has the model).
#   bash studies/gpu/bench.sh OUTDIR [kvfuse bench gpu arguments...]
set -o pipefail
out=$1; shift
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KVFUSE_TEST_MODEL_CACHE=/tmp/mc
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/nvidia-smi.txt"
python3 - <<'PY'
import shutil, torch
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM
d = Path("/tmp/mc/SmolLM2-135M-Instruct")
torch.manual_seed(0)
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(".gpu/tok")).save_pretrained(d)
for f in Path(".gpu/tok").iterdir():
    shutil.copy(f, d / f.name)
PY
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -m cuda -k "not greedy and not bf16_decodes" \
  tests/fusion/test_attention_paths.py tests/fusion/test_low_precision.py tests/store/test_device_tier.py 2>&1 | tee "$out/cuda-tests.txt" | tail -15
timeout "${BENCH_TIMEOUT:-300}" python3 -m kvfuse.cli bench gpu --tokenizer .gpu/tok --json "$out/gpu.json" "$@" \
  2>&1 | tee "$out/bench.log" | grep -v "method/s"
