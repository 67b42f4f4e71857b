"""`server.workers` > 1: several local worker processes behind the one dispatch interface.

On a multi-GPU host each worker gets its own device (`model.devices`, one worker per entry, in turn);
without that list they all use `model.device`. `server.kv_budget_tokens` (and `store.device_tier_mb`,
carved from it) is a device's: the workers that share one device share it, each given its share
(`device_shares`), so the device holds their sum within it. Each is a `WorkerSupervisor` of its own (its process,
restarts and pipe); a job goes to the ready worker with the fewest jobs (least loaded) and stays with
it; the queue limit and the running / waiting gauges count the whole pool. All of them open the host's
one LMDB store, as the API process already does (LMDB is multi-process). See docs/DESIGN.md, "Scale-out".
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from kvfuse.config import Settings
from kvfuse.service.dispatch.job_book import Job, QueueFull
from kvfuse.service.dispatch.supervisor import WorkerSupervisor
from kvfuse.service.metrics import Metrics
from kvfuse.service.wire import protocol as P


class _Member(WorkerSupervisor):
    """A supervisor whose gauges are the pool's sums."""

    pool: LocalPool

    def _gauges(self) -> None:
        self.pool.gauges()


class LocalPool:
    crash_advice = WorkerSupervisor.crash_advice

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.members: list[_Member] = []
        for own in device_shares(settings):
            member = _Member(own, metrics)
            member.pool = self
            self.members.append(member)
        self._owner: dict[Job, _Member] = {}

    # -- what the routes read ------------------------------------------------------------------------------
    def _first_ready(self) -> WorkerSupervisor:
        return next((m for m in self.members if m.ready), self.members[0])

    @property
    def ready(self) -> bool:
        return any(m.ready for m in self.members)

    @property
    def info(self) -> dict[str, Any]:
        return self._first_ready().info

    @property
    def pid(self) -> int | None:
        return self._first_ready().pid

    @property
    def restarts(self) -> int:
        return sum(m.restarts for m in self.members)

    @property
    def last_error(self) -> str | None:
        return next((m.last_error for m in self.members if m.last_error), None)

    @property
    def failed(self) -> str | None:
        """Failed once every member gave up: a device whose worker cannot start leaves the pool degraded
        (the others serve), not failed."""
        reasons = [m.failed for m in self.members]
        return reasons[0] if all(reasons) else None

    @property
    def steps(self) -> Any:
        return self._first_ready().steps

    @property
    def waiting(self) -> int:
        return sum(m.waiting for m in self.members)

    @property
    def running(self) -> int:
        return sum(m.running for m in self.members)

    def live_workers(self) -> list[dict[str, Any]]:
        return [w for m in self.members for w in m.live_workers()]

    @property
    def shadow_sink(self) -> Any:
        return self.members[0].shadow_sink

    @shadow_sink.setter
    def shadow_sink(self, sink: Any) -> None:
        for m in self.members:
            m.shadow_sink = sink

    def gauges(self) -> None:
        self.metrics.waiting.set(self.waiting)
        self.metrics.running.set(self.running)

    # -- lifecycle -----------------------------------------------------------------------------------------
    async def start(self) -> None:
        for m in self.members:
            await m.start()

    async def wait_ready(self, timeout: float) -> bool:
        waits = [asyncio.create_task(m.wait_ready(timeout)) for m in self.members]
        for done in asyncio.as_completed(waits):
            if await done:
                for w in waits:
                    w.cancel()
                return True
        return False

    async def stop(self) -> None:
        await asyncio.gather(*(m.stop() for m in self.members))

    def kill_worker(self) -> None:
        for m in self.members:
            m.kill_worker()

    # -- jobs ----------------------------------------------------------------------------------------------
    def submit(self, message: P.QueryJob | P.PrecomputeJob) -> Job:
        if isinstance(message, P.QueryJob) and self.waiting >= self.settings.server.queue_size:
            raise QueueFull(f"{self.waiting} queries are waiting")
        ready = ([m for m in self.members if m.ready] or [m for m in self.members if not m.failed]
                 or self.members)
        member = min(ready, key=lambda m: len(m._jobs))
        job = member.submit(message)
        self._owner[job] = member
        return job

    def cancel(self, job: Job) -> None:
        member = self._owner.get(job)
        if member is not None:
            member.cancel(job)

    async def events(self, job: Job, deadline: float | None = None) -> AsyncIterator[Any]:
        member = self._owner[job]
        try:
            async for msg in member.events(job, deadline):
                yield msg
        finally:
            if job.status.ended:
                self._owner.pop(job, None)


def device_shares(settings: Settings) -> list[Settings]:
    """Each local worker's settings: its device (`model.devices` in turn, else `model.device`) and its share
    of that device's KV budget (`server.kv_budget_tokens` and the device tier's `store.device_tier_mb`,
    split evenly among the workers on the device, the first ones taking the remainder)."""
    devices = settings.model.devices or [settings.model.device]
    placed = [devices[i % len(devices)] for i in range(settings.server.workers)]
    out = []
    for i, device in enumerate(placed):
        n, k = placed.count(device), placed[:i].count(device)  # workers on this device, and this one's place
        server = settings.server.model_copy(update={"kv_budget_tokens": _share(settings.server.kv_budget_tokens, n, k)})
        store = settings.store.model_copy(update={"device_tier_mb": _share(settings.store.device_tier_mb, n, k)})
        model = settings.model.model_copy(update={"device": device})
        out.append(settings.model_copy(update={"model": model, "server": server, "store": store}))
    return out


def _share(total: int, n: int, k: int) -> int:
    """The k-th of n even shares of `total` (the first `total % n` one more)."""
    return total // n + (1 if k < total % n else 0)
