"""The API side of the worker: starts it, feeds it one job at a time, routes its replies, restarts it.

Queries wait in a bounded queue (full -> 429); ingestion precompute jobs wait in their own queue and run
only when no query waits, so a large ingest never starves readers. Exactly one job is in flight, which
keeps supervision simple: when the worker dies, that job ends with `WorkerCrashed`, a new worker is
started, and the queued jobs proceed on it (they were never sent).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from kvfuse.config import Settings
from kvfuse.service.metrics import Metrics
from kvfuse.service.worker import worker_main

log = logging.getLogger(__name__)

FINAL_KINDS = frozenset({"result", "done", "error", "crashed", "cancelled"})


class QueueFull(Exception):
    """The query queue is full (429)."""


class WorkerCrashed(Exception):
    """The worker process died while running the job (503)."""


class WorkerUnavailable(Exception):
    """The service is shutting down (503)."""


class WorkerJobError(Exception):
    """The worker refused or failed the job; `kind` is one of kvfuse.service.worker.ERR_*."""

    def __init__(self, kind: str, message: str, excess_tokens: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.excess_tokens = excess_tokens


@dataclass(eq=False)
class Job:
    id: int
    kind: str  # "query" | "precompute"
    payload: dict
    enqueued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    cancelled: bool = False
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: asyncio.Event = field(default_factory=asyncio.Event)


class WorkerSupervisor:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.info: dict[str, Any] = {}
        self.last_error: str | None = None
        self.restarts = 0
        self._ctx = mp.get_context("spawn")
        self._proc: Any = None
        self._conn: Any = None
        self._cancel: Any = None
        self._generation = 0
        self._ready = asyncio.Event()
        self._work = asyncio.Event()
        self._queries: deque[Job] = deque()
        self._ingest: deque[Job] = deque()
        self._waiting = 0
        self._current: Job | None = None
        self._next_id = 1
        self._closing = False
        self._failures = 0  # consecutive starts that never reached "ready"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dispatcher: asyncio.Task | None = None
        self._restart_task: asyncio.Task | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._spawn()
        self._dispatcher = asyncio.create_task(self._dispatch(), name="kvfuse-dispatcher")

    async def wait_ready(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def stop(self) -> None:
        self._closing = True
        for task in (self._dispatcher, self._restart_task):
            if task is not None:
                task.cancel()
        for job in [*self._queries, *self._ingest] + ([self._current] if self._current else []):
            self._finish(job, "crashed", {"message": "the service is shutting down"})
        proc, conn = self._proc, self._conn
        if proc is None:
            return
        try:
            conn.send(("shutdown", 0, {}))
        except OSError:
            pass
        await asyncio.to_thread(proc.join, self.settings.server.worker_stop_timeout_s)
        if proc.is_alive():
            proc.kill()
            await asyncio.to_thread(proc.join, 5)
        conn.close()

    def _spawn(self) -> None:
        self._generation += 1
        gen = self._generation
        parent, child = self._ctx.Pipe(duplex=True)
        # A job id the worker polls between decode steps: setting it to a running job's id cancels it.
        self._cancel = self._ctx.RawValue("q", -1)
        proc = self._ctx.Process(target=worker_main, args=(self.settings, child, self._cancel),
                                 name="kvfuse-worker", daemon=True)
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        log.info("worker started (pid %d)", proc.pid)
        threading.Thread(target=self._read, args=(gen, proc, parent), name=f"kvfuse-worker-reader-{gen}",
                         daemon=True).start()

    def _read(self, gen: int, proc: Any, conn: Any) -> None:
        """Reader thread: forwards every worker message to the loop, then reports the exit."""
        assert self._loop is not None
        while True:
            ready = wait([conn, proc.sentinel])
            if conn in ready:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    break
                self._loop.call_soon_threadsafe(self._on_message, gen, msg)
            elif proc.sentinel in ready:
                break
        proc.join(5)
        self._loop.call_soon_threadsafe(self._on_exit, gen, proc.exitcode)

    def _on_message(self, gen: int, msg: tuple) -> None:
        if gen != self._generation:
            return
        kind, job_id, payload = msg
        if kind == "ready":
            self.info = payload
            self._failures = 0
            self.last_error = None
            self._ready.set()
            log.info("worker ready (pid %s, max context %s)", payload.get("pid"), payload.get("max_context_tokens"))
            return
        if kind == "fatal":
            self.last_error = payload.get("message")
            log.error("worker failed to start: %s", self.last_error)
            return
        job = self._current
        if job is None or job.id != job_id:
            return  # a late message of a job already ended (cancelled, timed out)
        if kind in FINAL_KINDS:
            self._finish(job, kind, payload)
        else:
            job.events.put_nowait((kind, payload))

    def _on_exit(self, gen: int, exitcode: int | None) -> None:
        if gen != self._generation:
            return
        self._ready.clear()
        if self._closing:
            return
        log.error("worker (pid %s) exited with code %s", self._proc.pid if self._proc else "?", exitcode)
        if self._current is not None:
            self._finish(self._current, "crashed", {"message": f"the worker process died (exit code {exitcode})"})
        if not self.info or self.last_error:
            self._failures += 1
        self.metrics.worker_restarts.inc()
        self.restarts += 1
        self._restart_task = asyncio.create_task(self._restart())

    async def _restart(self) -> None:
        # Back off only when starts keep failing (a bad model path); a crash after a healthy run restarts now.
        delay = min(30.0, 0.5 * 2 ** (self._failures - 1)) if self._failures else 0.0
        await asyncio.sleep(delay)
        if not self._closing:
            self._spawn()

    def kill_worker(self) -> None:
        """Kill the worker (it will be restarted); used when a cancelled job does not stop."""
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()

    # -- jobs ----------------------------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return self._waiting

    def submit(self, kind: str, payload: dict) -> Job:
        if self._closing:
            raise WorkerUnavailable("the service is shutting down")
        job = Job(id=self._next_id, kind=kind, payload=payload)
        self._next_id += 1
        if kind == "query":
            if self._waiting >= self.settings.server.queue_size:
                raise QueueFull(f"{self._waiting} queries are waiting")
            self._waiting += 1
            self.metrics.waiting.set(self._waiting)
            self._queries.append(job)
        else:
            self._ingest.append(job)
        self._work.set()
        return job

    def cancel(self, job: Job) -> None:
        """Cancel a job: dropped if still queued, stopped within one decode step if running."""
        if job.finished.is_set() or job.cancelled:
            return
        job.cancelled = True
        if job.started_at is None:
            if job.kind == "query":
                self._waiting -= 1
                self.metrics.waiting.set(self._waiting)
            self._finish(job, "cancelled", {})
            return
        if self._current is job and self._cancel is not None:
            self._cancel.value = job.id
            assert self._loop is not None
            self._loop.call_later(self.settings.server.worker_cancel_grace_s, self._enforce_cancel, job)

    def _enforce_cancel(self, job: Job) -> None:
        if self._current is job and not job.finished.is_set():
            log.error("job %d ignored its cancellation for %.0f s: killing the worker", job.id,
                      self.settings.server.worker_cancel_grace_s)
            self.kill_worker()

    def _finish(self, job: Job, kind: str, payload: dict) -> None:
        if not job.finished.is_set():
            job.events.put_nowait((kind, payload))
            job.finished.set()

    async def _dispatch(self) -> None:
        while True:
            await self._work.wait()
            await self._ready.wait()
            if self._queries:
                job = self._queries.popleft()
                if job.finished.is_set():
                    continue  # cancelled while queued (already uncounted)
                self._waiting -= 1
                self.metrics.waiting.set(self._waiting)
            elif self._ingest:
                job = self._ingest.popleft()
                if job.finished.is_set():
                    continue
            else:
                self._work.clear()
                continue
            job.started_at = time.monotonic()
            self._current = job
            is_query = job.kind == "query"
            if is_query:
                self.metrics.queue_time.observe(job.started_at - job.enqueued_at)
                self.metrics.running.inc()
            try:
                self._conn.send((job.kind, job.id, job.payload))
                await job.finished.wait()
            except OSError as err:
                self._finish(job, "crashed", {"message": f"the worker is unreachable: {err}"})
            finally:
                self._current = None
                if is_query:
                    self.metrics.running.dec()

    async def events(self, job: Job, deadline: float | None = None) -> AsyncIterator[tuple[str, dict]]:
        """The job's messages until its final one; raises on crash/refusal, TimeoutError past `deadline`
        (monotonic). The caller cancels the job when it stops iterating early."""
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            kind, payload = await asyncio.wait_for(job.events.get(), timeout)
            if kind == "crashed":
                raise WorkerCrashed(payload.get("message", "the worker process died"))
            if kind == "error":
                raise WorkerJobError(payload.get("kind", "internal"), payload.get("message", "worker error"),
                                     payload.get("excess_tokens"))
            yield kind, payload
            if kind in FINAL_KINDS:
                return

    async def run(self, kind: str, payload: dict, timeout: float | None = None) -> dict:
        """Submit a job and return its final payload."""
        job = self.submit(kind, payload)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            async for k, p in self.events(job, deadline):
                if k in FINAL_KINDS:
                    return p
        finally:
            self.cancel(job)
        raise WorkerCrashed("the job ended without a result")
