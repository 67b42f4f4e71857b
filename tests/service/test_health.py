"""What health means (kvfuse/service/health.py), with real processes: a server whose model can never load
turns /health 503 `failed` with the reason (in its log, to a valid key, and from `kvfuse serve --health`),
stops trying once the same load error repeats (or after server.worker_start_attempts), and answers 503
`model_failed` with that reason on every route that needs the model while search keeps working; one that is starting answers 503 `starting`; a fleet
API is starting until a worker joins and stays ok when its workers go; `kvfuse worker --health` says
starting, ok (with Redis gone for a moment too) and failed, from the worker's own status file. A ready
server with Redis stopped for a moment stays ok: test_redis_recovery.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fleet_helpers import WorkerProcess, wait_workers
from redis_server import free_port, start_redis
from service_helpers import API_KEY, MODEL_CACHE, REPO, ServerProcess, make_client, until

from kvfuse.model_files import DEFAULT, resolve_llm

pytestmark = pytest.mark.slow

FAST_GIVE_UP = {"KVFUSE_SERVER__WORKER_START_ATTEMPTS": "2", "KVFUSE_SERVER__API_KEYS": API_KEY}


def _model_copy(dest: Path) -> Path:
    src = Path(resolve_llm(DEFAULT, MODEL_CACHE))
    dest.mkdir(parents=True)
    for f in src.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


def _weights_cut(dest: Path) -> Path:
    """The default model with its weights file cut short: the tokenizer (what the API process reads)
    loads, the model (what the worker loads) never does."""
    model = _model_copy(dest)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return model


def _health(server: ServerProcess, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{server.url}/health", headers=headers, timeout=10)


def _answers(server: ServerProcess) -> bool:
    if server.proc is not None and server.proc.poll() is not None:
        raise RuntimeError(f"server exited:\n{server.log_tail()}")
    try:
        return _health(server).status_code in (200, 503)
    except httpx.TransportError:
        return False


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, **env}
    full.pop("KVFUSE_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "kvfuse.cli", *args], cwd=REPO, env=full, capture_output=True,
                          text=True, timeout=120)


def _model_failed(resp: httpx.Response, reason: str) -> None:
    """A 503 `model_failed` that carries /health's reason and no Retry-After (retrying cannot help)."""
    assert resp.status_code == 503, resp.text
    error = resp.json()["error"]
    assert error["code"] == "model_failed" and reason in error["message"], resp.text
    assert "retry-after" not in resp.headers


def test_a_worker_that_can_never_load_turns_health_failed_with_the_reason(tmp_path: Path) -> None:
    """Five starts allowed; the second repeats the first's load error word for word, so there is no third."""
    model = _weights_cut(tmp_path / "model")
    server = ServerProcess(tmp_path / "data", tmp_path / "server.log", KVFUSE_MODEL__LLM=str(model),
                           KVFUSE_SERVER__API_KEYS=API_KEY)
    try:
        server.start(wait=False)
        until(lambda: _answers(server), 120, "the API never answered")
        first = _health(server)
        assert first.status_code == 503 and first.json()["status"] == "starting", first.text
        failed = until(lambda: (r := _health(server)).json()["status"] == "failed" and r, 300, "never failed")
        assert failed.status_code == 503
        reason = failed.json()["reason"]
        assert "failed 2 starts in a row with the same load error" in reason and "SafetensorError" in reason, reason
        anon = _health(server, key=None).json()
        assert anon["status"] == "failed" and "reason" not in anon  # the reason names paths: a valid key's
        time.sleep(3)  # it gave up: no third start
        assert _health(server).json()["worker"]["restarts"] == 1
        assert "giving up on the model worker" in server.log_tail(400)
        with make_client(server) as c:  # each at once, before the (empty) corpus is looked at
            _model_failed(c.post("/v1/documents?wait=true", json={"id": "d", "text": "A short document."}), reason)
            _model_failed(c.post("/v1/query", json={"question": "What is it?"}), reason)
            chat = {"model": "kvfuse", "messages": [{"role": "user", "content": "What is it?"}]}
            _model_failed(c.post("/v1/chat/completions", json=chat), reason)
            _model_failed(c.post("/v1/chat/completions", json={**chat, "stream": True}), reason)
            search = c.post("/v1/search", json={"query": "What is it?"})
            assert search.status_code == 200 and search.json()["results"] == [], search.text
        probe = _cli("serve", "--health", "--port", str(server.port), KVFUSE_API_KEY=API_KEY)
        assert probe.returncode == 1 and "failed: the model worker failed 2 starts" in probe.stderr, probe.stderr
    finally:
        server.stop()


def test_model_files_it_cannot_read_turn_health_failed(tmp_path: Path) -> None:
    """The image's bug: model files the service's user cannot read (as root, a config that is not there to
    read). Whichever process meets it first (the API's tokenizer, the worker's model) the service fails."""
    model = _model_copy(tmp_path / "model")
    config = model / "config.json"
    if os.geteuid() == 0:  # root reads any mode: a link to nothing is as unreadable
        config.unlink()
        config.symlink_to(tmp_path / "nowhere.json")
    else:
        config.chmod(0)
    server = ServerProcess(tmp_path / "data", tmp_path / "server.log", KVFUSE_MODEL__LLM=str(model), **FAST_GIVE_UP)
    try:
        server.start(wait=False)
        until(lambda: _answers(server), 120, "the API never answered")
        failed = until(lambda: (r := _health(server)).json()["status"] == "failed" and r, 300, "never failed")
        reason = failed.json()["reason"]
        assert str(model) in reason, reason
        log = server.log_tail(400)
        assert "giving up on the model worker" in log or "service failed to start" in log
    finally:
        server.stop()


def test_fleet_health_from_the_api_and_the_workers_own_status(tmp_path: Path) -> None:
    port = free_port()
    redis_proc = start_redis(port, tmp_path)
    env = {"KVFUSE_REDIS_URL": f"redis://127.0.0.1:{port}/0", "KVFUSE_FLEET__HEARTBEAT_S": "0.5",
           "KVFUSE_FLEET__HEARTBEAT_TTL_S": "3", **FAST_GIVE_UP}
    api = ServerProcess(tmp_path / "api", tmp_path / "api.log", KVFUSE_SERVER__WORKERS="0", **env)
    good = WorkerProcess("good", tmp_path, **env)
    bad = WorkerProcess("bad", tmp_path, KVFUSE_MODEL__LLM=str(_weights_cut(tmp_path / "cut")), **env)
    try:
        api.start(wait=False)
        until(lambda: _answers(api), 120, "the API never answered")
        time.sleep(2)
        assert _health(api).json()["status"] == "starting"  # no worker has joined: it cannot answer yet
        good.start()
        bad.start()
        wait_workers(api.url, {"good"}, workers=[good])
        until(lambda: _health(api).status_code == 200, 60, "the fleet API never turned ok")
        probe = until(lambda: (p := _cli("worker", "--health", KVFUSE_DATA_DIR=str(good.data_dir))).returncode == 0
                      and p, 60, "the joined worker never probed ok")
        assert "ok: worker good is ready" in probe.stdout
        redis_proc.terminate()  # Redis gone for a moment: neither the worker nor the API turns unhealthy
        redis_proc.wait(10)
        time.sleep(4)
        assert _cli("worker", "--health", KVFUSE_DATA_DIR=str(good.data_dir)).returncode == 0
        assert _health(api).status_code == 200
        redis_proc = start_redis(port, tmp_path)
        failed = until(lambda: "failed" in (p := _cli("worker", "--health", KVFUSE_DATA_DIR=str(bad.data_dir))).stderr
                       and p, 300, "the worker that cannot load never probed failed")
        assert failed.returncode == 1 and "failed 2 starts in a row" in failed.stderr and "SafetensorError" in failed.stderr
        assert bad.proc.poll() is None  # kept up to report it, not in a restart loop
        good.kill()  # the fleet loses its only worker: /ready says so, the API itself is still ok
        until(lambda: httpx.get(f"{api.url}/ready", timeout=5).status_code == 503, 30, "/ready stayed 200")
        assert _health(api).status_code == 200
        assert _cli("worker", "--health", KVFUSE_DATA_DIR=str(good.data_dir)).returncode == 1  # its file is stale
        bad.proc.send_signal(signal.SIGTERM)
        assert bad.proc.wait(30) == 1
        assert not list((bad.data_dir / "run").glob("worker-*.json"))
    finally:
        for proc in (api, good, bad):
            proc.stop()
        redis_proc.terminate()
        redis_proc.wait(10)
