"""A private redis-server for tests that stop and restart Redis (no persistence unless asked), so the
shared server on 6379 is never disturbed; and a free loopback port to put it (or a kvfuse server) on."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


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
