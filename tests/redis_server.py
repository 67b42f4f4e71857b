"""A private redis-server for tests that stop and restart Redis (no persistence unless asked), so the
shared server on 6379 is never disturbed; a free loopback port to put it (or a kvfuse server) on; and the
Redis the other tests share: the one configured when it answers, else a private one (a fresh machine
runs no Redis)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(port: int, workdir: Path) -> subprocess.Popen:
    """redis-server on `port`, its files (if it saves) in `workdir`; returns once it answers PING."""
    import redis

    if shutil.which("redis-server") is None:
        raise RuntimeError("redis-server is not installed (these tests start a private one)")
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_connect_timeout=0.5)
    for _ in range(100):
        try:
            client.ping()
            return proc
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis-server did not start on port {port}")


def answers(url: str) -> bool:
    """Whether a Redis answers PING at `url`."""
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2).ping())
    except redis.exceptions.RedisError:
        return False


def shared_or_private(url: str, workdir: Path) -> tuple[str, subprocess.Popen | None]:
    """(`url`, None) when a Redis answers there; else a private redis-server started on a free port, as
    (its URL, with the same database number, and its process, for the caller to stop). Raises
    RuntimeError when neither is possible (redis-server not installed)."""
    if answers(url):
        return url, None
    port = free_port()
    proc = start_redis(port, workdir)
    parts = urlsplit(url)
    return urlunsplit(("redis", f"127.0.0.1:{port}", parts.path or "/0", "", "")), proc
