# `kvfuse bench gpu` and the CUDA half of the tests, from the repository root, on a GPU host that reaches
# no package index or model hub (the wheels the image lacks carried in .whl, the default model's tokenizer
# and config in .gpu/tok: studies/gpu/prepare.sh), or on a machine without CUDA, where the same steps run
# on the CPU in this checkout's .venv (the CUDA tests then skip). The tests' model cache gets the default
# model's shape with random weights. Writes OUTDIR/{device.txt,cuda-tests.txt,bench.log,gpu.json,gpu.md,gpu.png}.
#   bash studies/gpu/bench.sh OUTDIR [kvfuse bench gpu arguments...]
set -o pipefail
out=$1; shift
mkdir -p "$out"
. studies/gpu/python.sh || exit 1
tok=.gpu/tok; [ -d "$tok" ] || tok=data/models/SmolLM2-135M-Instruct
export PYTHONUNBUFFERED=1 KVFUSE_TEST_MODEL_CACHE=${KVFUSE_TEST_MODEL_CACHE:-/tmp/kvfuse-gpu-mc}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no CUDA device"; \
  $py -c "import sys, torch, transformers; print('found python', sys.version.split()[0], 'torch', torch.__version__, \
    'transformers', transformers.__version__)"; echo "pinned $(grep -E '^(torch|transformers)==' requirements.txt | tr '\n' ' ')"; \
  $py -c "from kvfuse.fusion.engine import static_support as s; m = s.missing(); \
    print('static decode path:', 'lacks ' + ', '.join(m) if m else 'available')"; } | tee "$out/device.txt"
TOK=$tok $py - <<'PY'
import os, shutil, torch
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM
d = Path(os.environ["KVFUSE_TEST_MODEL_CACHE"]) / "SmolLM2-135M-Instruct"
if not (d / "model.safetensors").exists():
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(os.environ["TOK"])).save_pretrained(d)
    for f in Path(os.environ["TOK"]).iterdir():
        if f.suffix in (".json", ".jinja"):
            shutil.copy(f, d / f.name)
PY
timeout "${TEST_TIMEOUT:-90}" $py -m pytest -q -p no:cacheprovider -m cuda -k "not greedy and not bf16_decodes" \
  tests/fusion/test_attention_paths.py tests/fusion/test_low_precision.py tests/fusion/test_engine_runner.py \
  tests/store/test_device_tier.py 2>&1 | tee "$out/cuda-tests.txt" | tail -15
timeout "${BENCH_TIMEOUT:-230}" $py -m kvfuse.cli bench gpu --tokenizer "$tok" --json "$out/gpu.json" "$@" \
  2>&1 | tee "$out/bench.log" | grep -v "method/s"
