"""A Redis index that comes up late, and one that goes away at runtime: the service waits for it at
startup (retrying with back-off) and becomes ready when it comes, and `/ready` says 503 while it is
gone and 200 once it is back (the index rebuilt from LMDB). `/health` is 503 `starting` until the service
was first ready, then stays 200 while Redis is gone (kvfuse/service/health.py: an outage is no reason to
restart a loaded server). A private redis-server on a free port is started late, stopped and started
again by the test."""

from __future__ import annotations

import time

import httpx
import pytest
from redis_server import free_port, start_redis
from service_helpers import ServerProcess, make_client, until, wait_job

pytestmark = pytest.mark.slow


def _ready(server: ServerProcess) -> httpx.Response:
    return httpx.get(f"{server.url}/ready", timeout=10)


def test_redis_late_at_startup_then_down_and_back_at_runtime(tmp_path, essays3: dict[str, str]) -> None:
    port = free_port()
    server = ServerProcess(tmp_path / "data", tmp_path / "server.log", KVFUSE_REDIS_URL=f"redis://127.0.0.1:{port}/0",
                           KVFUSE_STORE__REDIS_TIMEOUT_S="1", KVFUSE_RETRIEVER__CHUNK_TOKENS="128")
    redis_proc = None
    try:
        server.start(wait=False)
        until(lambda: _alive(server), 120, "the API never answered")
        time.sleep(5)  # Redis is not there: the service waits for it, it does not give up
        resp = _ready(server)
        assert resp.status_code == 503 and "document index" in resp.json()["error"]["message"], resp.text
        assert "startup_failed" not in resp.text
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "starting", health.text
        redis_proc = start_redis(port, tmp_path)
        server.wait_ready(300)  # ready once Redis came, with no restart
        with make_client(server) as c:
            resp = c.post("/v1/documents", json={"id": "pow", "text": essays3["pow"]})
            assert wait_job(c, resp.json()["job_id"])["status"] == "ready"
            redis_proc.terminate()
            redis_proc.wait(10)
            until(lambda: _ready(server).status_code == 503, 30, "/ready stayed 200 with Redis down")
            body = _ready(server).json()
            assert body["components"]["document_index"] is False
            health = httpx.get(f"{server.url}/health", timeout=10)
            assert health.status_code == 200 and health.json()["status"] == "ok", health.text
            assert c.get("/v1/documents/pow").status_code == 503
            redis_proc = start_redis(port, tmp_path)  # back, and empty
            until(lambda: _ready(server).status_code == 200, 60, "/ready stayed 503 with Redis back")
            doc = c.get("/v1/documents/pow")
            assert doc.status_code == 200 and doc.json()["status"] == "ready"  # rebuilt from LMDB
    finally:
        server.stop()
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(10)


def _alive(server: ServerProcess) -> bool:
    if server.proc is not None and server.proc.poll() is not None:
        raise RuntimeError(f"server exited:\n{server.log_tail()}")
    try:
        _ready(server)
        return True
    except httpx.TransportError:
        return False
