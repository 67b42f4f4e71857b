"""Helpers for fleet tests: `kvfuse worker` processes beside a `kvfuse serve --workers 0` API, each with
its own data dir (nothing shared between them but Redis), on a key prefix of the test's own."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
from service_helpers import API_KEY, KvfuseProcess, ServerProcess, read_stream

FLEET_TIMING = {  # fast failure detection for tests
    "KVFUSE_FLEET__HEARTBEAT_S": "0.5",
    "KVFUSE_FLEET__HEARTBEAT_TTL_S": "3",
    "KVFUSE_FLEET__REPLY_TTL_S": "10",
}


def fleet_env(redis_url: str, namespace: str) -> dict[str, str]:
    return {"KVFUSE_REDIS_URL": redis_url, "KVFUSE_STORE__REDIS_NAMESPACE": namespace,
            "KVFUSE_FLEET__NAMESPACE": f"{namespace}:fleet", **FLEET_TIMING}


class WorkerProcess(KvfuseProcess):
    """`python -m kvfuse.cli worker --name NAME` with its own data dir."""

    def __init__(self, name: str, root: Path, **env: str) -> None:
        super().__init__(root / f"worker-{name}", root / f"worker-{name}.log", **env)
        self.name = name

    def start(self) -> WorkerProcess:
        self._spawn(["worker", "--name", self.name])
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


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
    with client.stream("POST", "/v1/query", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        events = read_stream(resp)
    text = "".join(d["text"] for e, d in events if e == "token")
    return text, events
