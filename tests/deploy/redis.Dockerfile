# The deployment test's Redis, from its own Debian root (no image registry): Debian's redis-server, which
# runs the compose files' Redis command as the redis:7.4-alpine image would (ACL users, AOF in /data).
ARG BASE
FROM ${BASE}
RUN apt-get update && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /data
VOLUME ["/data"]
