# Source on a CUDA machine, in the repository root: installs the carried wheels (.whl) the image lacks and
# points kvfuse at the GPU, the carried essays (.gpu/data) and a reference cache that outlives one command.
#   . studies/gpu/env.sh && bash studies/gpu/model.sh random|gguf
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
mkdir -p /root/kvx
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 KVFUSE_MODEL__THREADS=1 \
  KVFUSE_MODEL__DEVICE=cuda KVFUSE_BENCH__DATA_DIR=$PWD/.gpu/data KVFUSE_BENCH__REFERENCE_DIR=/root/kvx/refs
