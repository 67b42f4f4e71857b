"""What "healthy" means for a kvfuse process, and the probes a container's health check runs.

An orchestrator acts on health: `docker compose up --wait` and `depends_on: service_healthy` wait for
healthy, and a container that stays unhealthy is what an operator (or an autoheal tool, or Kubernetes'
liveness probe) replaces. So health answers "will this process ever answer queries?", in three states:

- `starting`: it has not been ready yet (model, store, indexes loading; Redis perhaps not up yet). Not
  healthy, so `up --wait` returns only once kvfuse answers queries; Docker counts no failed probe during
  the start period, so a slow model load is no failure.
- `ok`: it was ready once and has not failed since. Transient trouble stays ok: Redis down for a moment,
  a worker that crashed and is being restarted, a fleet with no live worker. `/ready` reports those, and
  restarting the container would only throw away a loaded model.
- `failed`: it can never answer: the worker failed `server.worker_start_attempts` starts in a row (a load
  error, unreadable model files, a crash loop) and the supervisor gave up, or the store failed to open.
  The reason is logged once, at ERROR, and shown to a valid key.

`GET /health` answers 200 only when ok (503 otherwise, with the state); `kvfuse serve --health` probes it
from inside the container, and `kvfuse worker --health` reads the status file a fleet worker keeps
(`WorkerStatus`): the worker has no HTTP port.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

STARTING, OK, FAILED = "starting", "ok", "failed"
READY = "ready"  # a fleet worker's status once its model is loaded and it has joined the fleet

_FIRST_RESTART_DELAY_S = 0.5  # the pause after the first failed start; it doubles with each failure
_MAX_RESTART_DELAY_S = 30.0


def restart_delay_s(failures: int) -> float:
    """The pause before the next start after `failures` failed starts in a row: none after the crash of a
    worker that had loaded its model (it was healthy), then 0.5 s doubling up to 30 s (a bad model path
    must not spin)."""
    if failures <= 0:
        return 0.0
    return min(_MAX_RESTART_DELAY_S, _FIRST_RESTART_DELAY_S * 2 ** (failures - 1))


# -- kvfuse serve --health -----------------------------------------------------------------------------------
def probe_server(base_url: str, key: str | None, timeout_s: float = 5.0) -> tuple[int, str]:
    """(exit code, one line) for a container's health check: 0 when `/health` answers 200, else 1 with
    its state and reason (the key, when the container has one, lets the reason through). urllib, not
    httpx: the probe runs every few seconds and should cost little."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{base_url}/health")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return 0, _describe(json.loads(resp.read() or b"{}"))
    except urllib.error.HTTPError as err:
        try:
            body = json.loads(err.read() or b"{}")
        except ValueError:
            body = {"status": f"HTTP {err.code}"}
        return 1, _describe(body)
    except (OSError, ValueError) as err:  # URLError is an OSError: refused, timed out, unresolvable
        return 1, f"not answering at {base_url}: {getattr(err, 'reason', err)}"


def _describe(body: dict) -> str:
    status = body.get("status", "unknown")
    return f"{status}: {body['reason']}" if body.get("reason") else status


# -- kvfuse worker --health ----------------------------------------------------------------------------------
def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux's /proc/PID/stat, field 22), which
    tells a pid reused after a restart from the process that wrote a status file; None without /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int, started: str | None) -> bool:
    if pid <= 0:
        return False  # kill(0) would signal our own process group
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    return started is None or _process_start(pid) in (None, started)


class WorkerStatus:
    """A fleet worker's state (starting, ready, failed) in a file of its own, `<data_dir>/run/worker-<pid>.json`.

    The container's health check runs `kvfuse worker --health` in the same container, so it sees the same
    data dir and pids: it needs no Redis, so a short Redis outage does not make a loaded worker unhealthy.
    A file whose process is gone (or whose pid now names another process) is ignored and removed.
    """

    def __init__(self, data_dir: Path, name: str) -> None:
        self.path = Path(data_dir) / "run" / f"worker-{os.getpid()}.json"
        self.name = name
        self._started = _process_start(os.getpid())

    def set(self, state: str, reason: str | None = None) -> None:
        """Write the state (atomically: the probe never reads half a file)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "started": self._started, "name": self.name,
                                   "state": state, "reason": reason, "since": time.time()}))
        os.replace(tmp, self.path)

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()

    @staticmethod
    def probe(data_dir: Path) -> tuple[int, str]:
        """(exit code, one line): 0 when a live worker of this data dir is ready; 1 while none is, saying
        whether one failed (and why) or is starting."""
        live: list[dict] = []
        for path in sorted((Path(data_dir) / "run").glob("worker-*.json")):
            try:
                status = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # being replaced, or not ours
            if _alive(int(status.get("pid", 0)), status.get("started")):
                live.append(status)
            else:
                with contextlib.suppress(OSError):
                    path.unlink()
        if ready := [s for s in live if s.get("state") == READY]:
            return 0, f"ok: worker {ready[0].get('name')} is ready"
        if failed := [s for s in live if s.get("state") == FAILED]:
            return 1, f"failed: worker {failed[0].get('name')}: {failed[0].get('reason')}"
        if live:
            return 1, f"starting: worker {live[0].get('name')} is loading its model"
        return 1, f"no kvfuse worker runs on the data dir {data_dir}"


def start_with_retries(start: Callable[[], T], attempts: int, status: WorkerStatus) -> T | None:
    """`start()` (a fleet worker loading its model), tried up to `attempts` times with the supervisor's
    back-off; None when every try failed, with the status set to failed and the reason logged. A worker
    that could load on a later try (a device busy for a moment) recovers by itself."""
    status.set(STARTING)
    reason = "no start was tried"
    for attempt in range(1, attempts + 1):
        try:
            return start()
        except Exception as err:  # noqa: BLE001 - any load error: reported, tried again, then failed
            reason = f"{type(err).__name__}: {err}"
            log.exception("worker failed to start (try %d of %d): %s", attempt, attempts, reason)
        if attempt < attempts:
            time.sleep(restart_delay_s(attempt))
    status.set(FAILED, f"the worker failed {attempts} starts in a row; the last: {reason}")
    log.error("FAILED: the worker failed %d starts in a row; the last: %s", attempts, reason)
    return None


def wait_failed(status: WorkerStatus) -> int:
    """Keep a failed worker's process (and its status file) until SIGTERM / SIGINT, so its container's
    health check reports failed with the reason, rather than exiting into a restart loop that resets the
    container's health at every start; then exit code 1."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.error("kept running only to report the failure (kvfuse worker --health); stop it to exit")
    stop.wait()
    status.remove()
    return 1
