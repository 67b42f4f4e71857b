"""The API side of a fleet: jobs to `kvfuse worker`s on any host through Redis streams.

`FleetDispatcher` is a `JobBook` (job_book.py) like `WorkerSupervisor` (supervisor.py; `base.py` picks one), so
queries and ingestion do not know which transport runs them. Per job (keys in fleet.py):

1. the job's reply stream is opened (and kept from expiring while the API reads it);
2. the job goes out with XADD: a query to the stream of the live worker that routing.py picks,
   weighing the share of its chunks the worker holds (the sets workers report) against the jobs this
   dispatcher has at it; a query when no worker has room, and ingestion, to the shared stream, where the
   first worker with room takes it;
3. its Taken / Plan / Delta / Result / Done / Error entries are read back with a blocking XREAD;
4. nothing waits for a worker that is not there. Liveness is the heartbeats' (the signal /ready
   reports): with no live worker in the fleet a job is refused at once (NoLiveWorker: 503 with
   Retry-After), and every job in flight ends as soon as the last heartbeat lapses, since nothing
   restarts fleet workers; a job whose worker's heartbeat lapsed after a token went out ends at once
   with WorkerCrashed (an SSE error event, then [DONE]); one with no token, while another worker lives,
   is claimed and re-run by a survivor (fleet_worker.py). A cancelled job is marked in Redis for its
   worker to drop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter, deque
from typing import Any

from kvfuse.config import Settings
from kvfuse.service.dispatch.job_book import Cancelled, Crashed, Job, JobBook, NoLiveWorker
from kvfuse.service.dispatch.routing import Candidate, pick_worker
from kvfuse.service.metrics import Metrics
from kvfuse.service.wire import protocol as P
from kvfuse.service.wire.codec import CodecError, decode, encode
from kvfuse.service.wire.fleet_keys import FleetKeys, read_heartbeats_async

log = logging.getLogger(__name__)

_READ_BLOCK_MS = 500  # one blocking read of a reply stream; liveness is checked between reads


class FleetDispatcher(JobBook):
    pid = None  # no local worker process
    crash_advice = "retry the request"  # nothing restarts a fleet worker; the others take new requests

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        if not settings.redis_url:
            raise ValueError("server.workers = 0 dispatches to `kvfuse worker`s through Redis: set redis_url")
        super().__init__(settings, metrics)
        self.fleet = settings.fleet
        self.keys = FleetKeys(self.fleet.namespace)
        self.info: dict[str, Any] = {}
        self.workers: dict[str, dict] = {}  # live workers' heartbeats
        self.last_error: str | None = "no live worker has joined the fleet yet"
        self.steps: deque = deque(maxlen=1)  # engine steps are the workers' (see their heartbeats)
        self.restarts = 0
        self._r: Any = None
        self._uids: dict[int, str] = {}
        self._at: dict[int, str] = {}  # job id -> the worker it was sent to or taken by, until it ends
        self._tasks: set[asyncio.Task] = set()
        self._monitor: asyncio.Task | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------
    async def start(self) -> None:
        from kvfuse.store.redis_access import RedisAccess

        self._access = RedisAccess.of(self.settings)
        self._r = self._access.async_client(decode_responses=True, read_timeout=False)
        self._monitor = asyncio.create_task(self._watch(), name="kvfuse-fleet-monitor")
        shadow = asyncio.create_task(self._read_shadow(), name="kvfuse-fleet-shadow")
        self._tasks.add(shadow)
        shadow.add_done_callback(self._tasks.discard)

    async def _read_shadow(self) -> None:
        """The workers' shadow-check verdicts (from those written after this API started) to the ledger."""
        last = "$"
        while not self._closing:
            try:
                got = await self._r.xread({self.keys.shadow: last}, count=256, block=1000) or []
            except Exception as err:  # noqa: BLE001 - Redis down: the heartbeat watch reports it
                log.debug("shadow stream unavailable: %s", err)
                await asyncio.sleep(1.0)
                continue
            for _, entries in got:
                for entry_id, fields in entries:
                    last = entry_id
                    try:
                        self._on_shadow(decode(fields))
                    except CodecError as err:
                        log.warning("bad shadow entry %s: %s", entry_id, err)

    async def _watch(self) -> None:
        """Keep the live workers' heartbeats (for /ready, /metrics, dispatch and liveness)."""
        while not self._closing:
            try:
                self.workers = await read_heartbeats_async(self._r, self.keys)
                fps = {w["fingerprint"] for w in self.workers.values()}
                if self.workers:
                    self.info = next(iter(self.workers.values())).get("info", {})
                    self.last_error = None if len(fps) == 1 else f"live workers run different models: {sorted(fps)}"
                    self._ready.set()
                else:
                    self.last_error = "no live worker in the fleet"
                    self._ready.clear()
                self.metrics.live_workers.set(len(self.workers))
            except Exception as err:  # noqa: BLE001 - Redis down: no worker counts as live
                self.workers = {}
                self._ready.clear()
                denied = self._access.denied(err)
                self.last_error = str(denied) if denied else f"the fleet's Redis is unavailable: {err}"
            await asyncio.sleep(min(0.5, self.fleet.heartbeat_s))

    async def stop(self) -> None:
        self._closing = True
        for job in list(self._jobs.values()):
            self._finish(job, Crashed("the service is shutting down"))
        if self._r is not None:
            with contextlib.suppress(Exception):
                await self._mark_cancelled(list(self._uids.values()))
        for task in [*self._tasks, *([self._monitor] if self._monitor else [])]:
            task.cancel()
        if self._r is not None:
            await self._r.aclose()

    def kill_worker(self) -> None:
        """No local worker to kill: a cancelled job is dropped by its worker (cancel key)."""

    # -- jobs ----------------------------------------------------------------------------------------------
    def live_workers(self) -> list[dict[str, Any]]:
        keep = ("host", "pid", "device", "fingerprint", "kv_budget_tokens", "kv_free_tokens", "running", "waiting",
                "max_running_requests", "kv", "kv_pool_bytes", "kv_budget_bytes", "kv_ledger", "shadow")
        return [{"id": wid, **{k: b.get(k) for k in keep}, "prompt": (b.get("info") or {}).get("prompt")}
                for wid, b in sorted(self.workers.items())]

    def submit(self, message: P.QueryJob | P.PrecomputeJob) -> Job:
        if not self.workers:
            raise NoLiveWorker(self.last_error or "no live worker in the fleet")
        job = self._register(message)
        self._uids[job.id] = uuid.uuid4().hex
        task = asyncio.create_task(self._drive(job), name=f"kvfuse-job-{job.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    async def _target_for(self, job: Job) -> str | None:
        """The worker whose own stream the job goes to (routing.py), or None for the shared stream."""
        if not isinstance(job.message, P.QueryJob) or not self.workers:
            return None
        keys = [c.key for c in job.message.chunks]
        ids = list(self.workers)
        held = [0] * len(ids)
        if keys:
            pipe = self._r.pipeline(transaction=False)
            for wid in ids:
                pipe.smismember(self.keys.holds(wid), keys)
            held = [sum(bool(f) for f in flags) for flags in await pipe.execute()]
        jobs = Counter(self._at.values())
        candidates = [Candidate(wid, h, jobs[wid], self.workers[wid].get("max_running_requests", 1))
                      for wid, h in zip(ids, held, strict=True) if wid in self.workers]
        return pick_worker(candidates, len(keys), self.fleet.route_load_weight)

    async def _drive(self, job: Job) -> None:
        uid = self._uids[job.id]
        reply, ttl_ms = self.keys.reply(uid), int(self.fleet.reply_ttl_s * 1000)
        try:
            await self._r.xadd(reply, {"t": "Open"})
            await self._r.pexpire(reply, ttl_ms)
            target = await self._target_for(job)
            if target is not None:
                self._at[job.id] = target
            await self._r.xadd(self.keys.jobs if target is None else self.keys.direct(target),
                               encode(job.message, uid=uid))
            await self._read(job, reply, ttl_ms)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - Redis failed: the job ends, it never hangs
            log.warning("job %d failed in the fleet transport: %s", job.id, err)
            self._finish(job, Crashed(f"the fleet's Redis failed: {err}"))
        finally:
            self._at.pop(job.id, None)
            self._uids.pop(job.id, None)
            with contextlib.suppress(Exception):
                await self._r.delete(reply)

    async def _read(self, job: Job, reply: str, ttl_ms: int) -> None:
        last, worker, tokens = "0-0", None, False
        while not job.status.ended:
            got = await self._r.xread({reply: last}, count=256, block=_READ_BLOCK_MS)
            await self._r.pexpire(reply, ttl_ms)
            for _, entries in got or []:
                for entry_id, fields in entries:
                    last = entry_id
                    kind = fields.get("t")
                    if kind == "Open":
                        continue
                    if kind == "Taken":
                        worker = job.worker = fields.get("w")
                        if worker is not None:
                            self._at[job.id] = worker  # its load now, wherever it was sent
                        continue
                    if fields.get("w", worker) != worker:
                        continue  # from a worker the job was taken from (presumed dead): not this answer's
                    try:
                        msg = decode(fields)
                    except CodecError as err:
                        log.error("job %d: bad reply entry: %s", job.id, err)
                        continue
                    msg.job_id = job.id
                    tokens = tokens or isinstance(msg, P.Delta)
                    self._on_message(job, msg)
            if job.status.ended:
                return
            # Liveness: nothing waits for a worker that is not there (see the module docstring).
            if not self.workers:
                why = self.last_error or "no live worker in the fleet"
                if worker is not None:
                    why = f"the worker {worker} serving this request died: {why}"
                self._finish(job, Crashed(why, NoLiveWorker))
                return
            if worker is not None and worker not in self.workers and tokens:
                self._finish(job, Crashed(f"the worker {worker} serving this request died"))
                return
            if job.cancel_requested and job.cancel_deadline is not None and time.monotonic() > job.cancel_deadline:
                self._finish(job, Crashed("the cancelled job did not stop in time"))
                return

    def _on_message(self, job: Job, msg: Any) -> None:
        if isinstance(msg, P.Plan):
            if job.status is not P.JobStatus.WAITING:
                return  # the same plan again, from a worker that re-ran the job
            self._started(job)
        if isinstance(msg, P.FINAL):
            self._count_usage(msg)
            if isinstance(msg, P.Error) and msg.kind == P.ERR_WORKER_LOST:
                self._finish(job, Crashed(msg.message))
                return
            self._finish(job, msg)
        else:
            job.events.put_nowait(msg)

    async def _mark_cancelled(self, uids: list[str]) -> None:
        if not uids:
            return
        pipe = self._r.pipeline(transaction=False)
        for uid in uids:
            pipe.set(self.keys.cancel(uid), 1, px=int(self.fleet.reply_ttl_s * 1000))
        await pipe.execute()

    def cancel(self, job: Job) -> None:
        if job.status.ended or job.cancel_requested:
            return
        job.cancel_requested = True
        uid = self._uids.get(job.id)
        if uid is not None:
            task = asyncio.create_task(self._mark_cancelled([uid]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if job.status is P.JobStatus.WAITING:
            self._finish(job, Cancelled())
            return
        job.cancel_deadline = time.monotonic() + self.settings.server.worker_cancel_grace_s
