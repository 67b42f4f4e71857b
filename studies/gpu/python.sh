# Sourced by bench.sh and targets.sh: the Python they run. On a CUDA host, the image's python3 with the
# carried wheels (.whl) installed into /tmp/site; elsewhere this checkout's .venv (or $PYTHON).
if command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi > /dev/null 2>&1; then
  KVFUSE_GPU=1 py=python3
  [ -f /tmp/site/.carried ] || { $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && touch /tmp/site/.carried; } || return 1
  export PYTHONPATH=/tmp/site:$PWD
else
  KVFUSE_GPU= py=${PYTHON:-.venv/bin/python}
  export PYTHONPATH=$PWD
fi
