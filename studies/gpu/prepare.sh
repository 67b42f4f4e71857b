# On this (CPU) host, from the repository root: what a bare GPU host needs carried, since it reaches no
# package index or model hub. .whl: the pinned wheels of requirements*.txt that the GPU image may lack or
# hold at other versions, without dependencies (the image's CUDA torch, numpy and their kin stay; faiss,
# the linters and the OpenAI client are not used there), for the image's Python (PYVER, default 3.12); .gpu/tok: the default model's tokenizer,
# template and config (no weights). Both are git-ignored: name them in the run's `carry`.
#   bash studies/gpu/prepare.sh [PYVER]
set -euo pipefail
pyver=${1:-3.12}
rm -rf .whl && mkdir -p .whl .gpu/tok
grep -hv '^\s*#' requirements.txt requirements-test.txt | grep -Ev '^(torch|numpy|faiss-cpu|ruff|openai)==|^\s*$' > /tmp/kvfuse-gpu-reqs.txt
.venv/bin/pip download -q --only-binary=:all: --python-version "$pyver" --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --implementation cp -d .whl \
  -r /tmp/kvfuse-gpu-reqs.txt --no-deps
m=data/models/SmolLM2-135M-Instruct
cp $m/config.json $m/generation_config.json $m/tokenizer.json $m/tokenizer_config.json $m/chat_template.jinja .gpu/tok/
du -sh .whl .gpu/tok
