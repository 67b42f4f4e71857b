"""Helpers for fleet tests: `kvfuse worker` processes beside a `kvfuse serve --workers 0` API, each with
its own data dir (nothing shared between them but Redis), on a key prefix of the test's own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from service_helpers import API_KEY, MODEL_CACHE, REPO, ServerProcess

FLEET_TIMING = {  # fast failure detection for tests
    "KVFUSE_FLEET__HEARTBEAT_S": "0.5",
    "KVFUSE_FLEET__HEARTBEAT_TTL_S": "3",
    "KVFUSE_FLEET__REPLY_TTL_S": "10",
    "KVFUSE_FLEET__ORPHAN_TIMEOUT_S": "60",
}


def fleet_env(redis_url: str, namespace: str) -> dict[str, str]:
    return {"KVFUSE_REDIS_URL": redis_url, "KVFUSE_STORE__REDIS_NAMESPACE": namespace,
            "KVFUSE_FLEET__NAMESPACE": f"{namespace}:fleet", **FLEET_TIMING}


class WorkerProcess:
    """`python -m kvfuse.cli worker --name NAME` with its own data dir."""

    def __init__(self, name: str, root: Path, **env: str) -> None:
        self.name = name
        self.data_dir = root / f"worker-{name}"
        self.log_path = root / f"worker-{name}.log"
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self) -> WorkerProcess:
        env = {**os.environ, "KVFUSE_DATA_DIR": str(self.data_dir), "KVFUSE_MODEL_CACHE_DIR": str(MODEL_CACHE),
               "KVFUSE_LOG_LEVEL": "info", **self.env}
        env.pop("KVFUSE_CONFIG", None)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen([sys.executable, "-m", "kvfuse.cli", "worker", "--name", self.name], cwd=REPO,
                                     env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""


def start_api(root: Path, env: dict[str, str]) -> ServerProcess:
    """The API with no model (`--workers 0`), ready once a worker is live."""
    return ServerProcess(root / "api", root / "api.log", KVFUSE_SERVER__WORKERS="0", KVFUSE_SERVER__API_KEYS=API_KEY,
                         **env).start()


def live_workers(url: str) -> dict[str, dict]:
    try:
        resp = httpx.get(f"{url}/ready", timeout=5, headers={"Authorization": f"Bearer {API_KEY}"})
    except httpx.TransportError:
        return {}
    return {w["id"]: w for w in resp.json().get("workers", [])}


def wait_workers(url: str, names: set[str], timeout: float = 300.0, workers: list[WorkerProcess] = ()) -> dict:
    """Wait until exactly `names` are live (as /ready reports them)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = live_workers(url)
        if set(live) == names:
            return live
        for w in workers:
            if w.proc is not None and w.proc.poll() is not None and w.name in names:
                raise RuntimeError(f"worker {w.name} exited with {w.proc.returncode}:\n{w.log_tail()}")
        time.sleep(0.5)
    raise TimeoutError(f"live workers {sorted(live_workers(url))}, expected {sorted(names)}")


def query(client: httpx.Client, body: dict) -> tuple[str, list[tuple[str | None, object]]]:
    """A streamed query: (answer text, every event)."""
    events: list[tuple[str | None, object]] = []
    with client.stream("POST", "/v1/query", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        event = None
        for line in resp.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
                events.append((event, data if data == "[DONE]" else json.loads(data)))
                event = None
    text = "".join(d["text"] for e, d in events if e == "token")
    return text, events
