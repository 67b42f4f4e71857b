# On this (CPU) host, from the repository root: what a bare GPU host needs carried, since it reaches no
# package index or model hub. .whl: every wheel kvfuse needs beyond the host image's packages
# (studies/gpu/image-packages.txt), resolved with their dependencies for the image's Python (PYVER,
# default 3.12) by studies/gpu/carry.py, which lists what it carried and why in .whl/CARRIED.txt; the
# image's CUDA torch and numpy stay, and faiss, the linters, the OpenAI client and the parser study's
# candidates are not used there. .gpu/tok: the default model's tokenizer, template and config (no
# weights). Both are git-ignored: name them in the run's `carry`.
#   bash studies/gpu/prepare.sh [PYVER]
set -euo pipefail
pyver=${1:-3.12}
rm -rf .whl && mkdir -p .whl .gpu/tok
.venv/bin/python studies/gpu/carry.py .whl --python "$pyver" --image studies/gpu/image-packages.txt \
  -r requirements.txt -r requirements-test.txt --skip faiss-cpu --skip ruff --skip openai --skip fpdf2 \
  --skip pdfminer.six --skip inscriptis --skip beautifulsoup4 > /dev/null
m=data/models/SmolLM2-135M-Instruct
cp $m/config.json $m/generation_config.json $m/tokenizer.json $m/tokenizer_config.json $m/chat_template.jinja .gpu/tok/
grep -c '^carry' .whl/CARRIED.txt
du -sh .whl .gpu/tok
