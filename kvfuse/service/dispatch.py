"""One dispatch interface, two transports: which one runs the model for this API process.

- `server.workers = 1` (the embedded default): a local worker process over a pipe (supervisor.py);
  `server.workers = N`: N of them, one per `model.devices` entry in turn (local_pool.py).
- `server.workers = 0` with `redis_url`: `kvfuse worker` processes on any host, through Redis streams
  (fleet_dispatch.py, fleet_worker.py; docs/DESIGN.md, "Scale-out").

Both offer submit / events / cancel / run and the readiness the routes use, so queries and ingestion
never know which one runs them.
"""

from __future__ import annotations

from typing import Any

from kvfuse.config import Settings
from kvfuse.service.metrics import Metrics


def is_fleet(settings: Settings) -> bool:
    return settings.server.workers == 0


def make_dispatcher(settings: Settings, metrics: Metrics) -> Any:
    if is_fleet(settings):
        from kvfuse.service.fleet_dispatch import FleetDispatcher

        return FleetDispatcher(settings, metrics)
    if settings.server.workers > 1:
        from kvfuse.service.local_pool import LocalPool

        return LocalPool(settings, metrics)
    from kvfuse.service.supervisor import WorkerSupervisor

    return WorkerSupervisor(settings, metrics)


def live_workers(dispatcher: Any) -> list[dict]:
    """The live workers as /ready reports them (the local worker when embedded), each by the name its
    answers carry (`worker` of a query's result): the worker's own."""
    beats = getattr(dispatcher, "workers", None)
    if beats is None:
        members = getattr(dispatcher, "members", [dispatcher])
        return [{"id": m.info.get("name"), "pid": m.pid, "device": m.settings.model.device,
                 "fingerprint": m.info.get("fingerprint"), "running": m.running, "waiting": m.waiting}
                for m in members if m.ready]
    keep = ("host", "pid", "device", "fingerprint", "kv_budget_tokens", "kv_free_tokens", "running", "waiting",
            "max_running_requests", "kv")
    return [{"id": wid, **{k: b.get(k) for k in keep}} for wid, b in sorted(beats.items())]


def open_api_store(settings: Settings) -> Any:
    """The API process's store: the document catalog, plus the chunk blobs when the worker is local; a
    fleet's API keeps no blobs (kvfuse.store.remote_blobs) and removes shared copies of dropped chunks."""
    from kvfuse.store import KVStore

    if not is_fleet(settings):
        return KVStore.open(settings)
    from kvfuse.service.fleet import FleetKeys
    from kvfuse.store.shared_tier import RedisTier

    f = settings.fleet
    shared = (RedisTier(settings.redis_url, FleetKeys(f.namespace).shared_kv, f.shared_tier_mb << 20,
                        timeout_s=settings.store.redis_timeout_s) if f.shared_tier_mb else None)
    return KVStore.open(settings, shared=shared, keep_blobs=False)
