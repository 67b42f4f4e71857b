"""One dispatch interface, two transports: which one runs the model for this API process.

- `server.workers = 1` (the embedded default): a local worker process over a pipe (supervisor.py);
  `server.workers = N`: N of them, one per `model.devices` entry in turn (local_pool.py).
- `server.workers = 0` with `redis_url`: `kvfuse worker` processes on any host, through Redis streams
  (fleet.py here, worker/fleet_worker.py there; docs/DESIGN.md, "Scale-out").

All offer the `Dispatcher` interface, so queries and ingestion never know which one runs them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from kvfuse.config import Settings
from kvfuse.service.errors import APIError, model_failed
from kvfuse.service.metrics import Metrics

if TYPE_CHECKING:
    from kvfuse.service.dispatch.job_book import Job
    from kvfuse.service.wire import protocol as P
    from kvfuse.store import KVStore


def is_fleet(settings: Settings) -> bool:
    return settings.server.workers == 0


class Dispatcher(Protocol):
    """What the API process needs of whatever runs the model: a local worker (supervisor.py), a local pool
    (local_pool.py) or a fleet (fleet.py). Jobs and their errors are job_book.py's."""

    crash_advice: str  # what a client should do after a worker crashed under its request
    shadow_sink: Any  # called with each shadow-check verdict from a worker (job_book.JobBook._on_shadow)

    @property
    def ready(self) -> bool: ...
    @property
    def info(self) -> dict[str, Any]: ...  # the worker's Ready info: name, fingerprint, max_context_tokens, ...
    @property
    def last_error(self) -> str | None: ...
    @property
    def failed(self) -> str | None:
        """Why no worker will ever take jobs (a local supervisor gave up; health.py's `failed`), else None."""
        ...
    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def wait_ready(self, timeout: float) -> bool: ...
    def submit(self, message: P.QueryJob | P.PrecomputeJob) -> Job: ...
    def cancel(self, job: Job) -> None: ...
    def events(self, job: Job, deadline: float | None = None) -> AsyncIterator[Any]: ...
    def live_workers(self) -> list[dict[str, Any]]:
        """The live workers as /ready reports them, each by the name its answers carry."""
        ...


def make_dispatcher(settings: Settings, metrics: Metrics) -> Dispatcher:
    if is_fleet(settings):
        from kvfuse.service.dispatch.fleet import FleetDispatcher

        return FleetDispatcher(settings, metrics)
    if settings.server.workers > 1:
        from kvfuse.service.dispatch.local_pool import LocalPool

        return LocalPool(settings, metrics)
    from kvfuse.service.dispatch.supervisor import WorkerSupervisor

    return WorkerSupervisor(settings, metrics)


def open_api_store(settings: Settings) -> KVStore:
    """The API process's store: the document catalog, plus the chunk blobs when the worker is local; a
    fleet's API keeps no blobs (kvfuse.store.remote_blobs) and removes shared copies of dropped chunks."""
    from kvfuse.store import KVStore

    if not is_fleet(settings):
        return KVStore.open(settings)
    from kvfuse.service.wire.fleet_keys import shared_tier

    return KVStore.open(settings, shared=shared_tier(settings), keep_blobs=False)


async def require_worker(dispatcher: Dispatcher, timeout_s: float) -> None:
    """Wait up to `timeout_s` for the dispatcher's worker(s); 503 if none is ready by then."""
    if not await dispatcher.wait_ready(timeout_s):
        if dispatcher.failed:
            raise model_failed(dispatcher.failed)
        raise APIError(503, f"the model worker is not ready: {dispatcher.last_error or 'starting'}",
                       code="worker_unavailable")
