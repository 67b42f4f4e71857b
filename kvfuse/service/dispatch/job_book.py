"""The API side's book of worker jobs, one for every transport.

`WorkerSupervisor` (a local worker process over a pipe, supervisor.py) and `FleetDispatcher` (`kvfuse
worker`s through Redis, fleet.py) differ in how a job reaches a worker and how its replies come
back; everything else is this: job ids, the waiting / running query counts behind the queue limit
(`server.queue_size` → `QueueFull`, 429) and the gauges, a job's start and end, and the stream of its
messages that the query and ingestion code read. The outcomes a caller sees are defined here too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvfuse.config import Settings
from kvfuse.service.metrics import Metrics
from kvfuse.service.wire import protocol as P


class QueueFull(Exception):
    """The query queue is full (429)."""


class WorkerCrashed(Exception):
    """The worker process died while running the job (503)."""


class NoLiveWorker(WorkerCrashed):
    """A fleet has no live worker (by the heartbeats /ready reads) to run the job: 503 at once, with
    Retry-After, rather than a wait for a worker nothing is going to start. A kind of WorkerCrashed, so
    whoever retries a job its worker lost retries this one too."""


class WorkerFailed(WorkerCrashed):
    """The model worker can never start: its supervisor gave up after `server.worker_start_attempts`
    failed starts (503, and no Retry-After: retrying will not help; /health says failed)."""


class WorkerUnavailable(Exception):
    """The service is shutting down (503)."""


class WorkerJobError(Exception):
    """The worker refused or failed the job; `kind` is one of kvfuse.service.wire.protocol.ERR_*."""

    def __init__(self, kind: str, message: str, excess_tokens: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.excess_tokens = excess_tokens


@dataclass
class Crashed:
    """A job's end on the API side: its worker died (or the service stopped); `error` is what the
    job's reader raises."""

    message: str
    error: type[WorkerCrashed] = WorkerCrashed


@dataclass
class Cancelled:
    """A job's end on the API side: cancelled before the worker started it."""


@dataclass(eq=False)
class Job:
    """A job on the API side of the seam: its message, where it stands (`status`, set by the JobBook
    alone) and the queue its worker's messages arrive on."""

    id: int
    message: P.QueryJob | P.PrecomputeJob
    status: P.JobStatus = P.JobStatus.WAITING
    enqueued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    cancel_requested: bool = False  # cancel() was called; the status says whether it has ended yet
    worker: str | None = None  # the fleet worker that took it (fleet.py)
    cancel_deadline: float | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def kind(self) -> str:
        return "query" if isinstance(self.message, P.QueryJob) else "precompute"


class JobBook:
    """Jobs submitted and not finished, and the query counts; a transport subclasses it."""

    # What a client whose job's worker died is told to do (after the error): a local worker is restarted.
    crash_advice = "it is being restarted, retry the request"

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self._ready = asyncio.Event()  # a worker can take jobs
        # Why no worker will ever take jobs (the supervisor gave up), set once by give_up; None while one may.
        self.failed: str | None = None
        self._gave_up = asyncio.Event()
        self._jobs: dict[int, Job] = {}  # submitted, not finished
        self._waiting = 0  # queries submitted and not yet admitted
        self._running = 0  # queries admitted and not finished
        self._next_id = 1
        self._closing = False
        # Where a worker's shadow-check verdicts go (P.ShadowResult / P.ShadowDropped): the API's fidelity
        # ledger (rag/fidelity.py), set by the composition root; None drops them.
        self.shadow_sink: Callable[[Any], None] | None = None

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def running(self) -> int:
        return self._running

    async def wait_ready(self, timeout: float) -> bool:
        """True once a worker can take jobs; False after `timeout` s, or at once when it never will."""
        waits = [asyncio.ensure_future(self._ready.wait()), asyncio.ensure_future(self._gave_up.wait())]
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return self.ready

    def give_up(self, reason: str) -> None:
        """No worker will ever take jobs: every job ends with WorkerFailed, new ones are refused with it,
        and wait_ready answers False at once (health.py: the service is failed)."""
        self.failed = reason
        self._gave_up.set()
        for job in list(self._jobs.values()):
            self._finish(job, Crashed(reason, WorkerFailed))

    def _register(self, message: P.QueryJob | P.PrecomputeJob) -> Job:
        """A new job with its id, counted as waiting if it is a query; raises WorkerUnavailable while the
        service stops, WorkerFailed once its worker can never start, and QueueFull when `server.queue_size`
        queries already wait."""
        if self._closing:
            raise WorkerUnavailable("the service is shutting down")
        if self.failed:
            raise WorkerFailed(self.failed)
        is_query = isinstance(message, P.QueryJob)
        if is_query and self._waiting >= self.settings.server.queue_size:
            raise QueueFull(f"{self._waiting} queries are waiting")
        message.job_id = self._next_id
        self._next_id += 1
        job = Job(id=message.job_id, message=message)
        self._jobs[job.id] = job
        if is_query:
            self._waiting += 1
            self._gauges()
        return job

    def _on_shadow(self, msg: Any) -> None:
        if self.shadow_sink is not None:
            self.shadow_sink(msg)

    def _started(self, job: Job) -> None:
        """The worker admitted the job (a query's Plan, a precompute's first step)."""
        if job.status is not P.JobStatus.WAITING:
            return
        job.status = P.JobStatus.RUNNING
        job.started_at = time.monotonic()
        if job.kind == "query":
            self._waiting -= 1
            self._running += 1
            self.metrics.queue_time.observe(job.started_at - job.enqueued_at)
            self._gauges()

    def _gauges(self) -> None:
        self.metrics.waiting.set(self._waiting)
        self.metrics.running.set(self._running)

    def _count_usage(self, msg: Any) -> None:
        """A query's Result into the token counters."""
        if isinstance(msg, P.Result):
            u = msg.usage
            self.metrics.generation_tokens.inc(u.get("generated_tokens", 0))
            self.metrics.prompt_tokens.inc(P.prompt_tokens(u))

    def _finish(self, job: Job, msg: Any) -> None:
        """End the job with its final message (or Crashed / Cancelled)."""
        if job.status.ended:
            return
        self._jobs.pop(job.id, None)
        if job.kind == "query":
            if job.status is P.JobStatus.WAITING:
                self._waiting -= 1
            else:
                self._running -= 1
            self._gauges()
        job.status = _end_status(job, msg)
        job.events.put_nowait(msg)
        job.finished.set()

    async def events(self, job: Job, deadline: float | None = None) -> AsyncIterator[Any]:
        """The job's messages (protocol dataclasses) through its final one (Result, Done or Cancelled);
        raises WorkerCrashed (NoLiveWorker) / WorkerJobError, TimeoutError past `deadline` (monotonic). The caller
        cancels the job when it stops iterating early."""
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            msg = await asyncio.wait_for(job.events.get(), timeout)
            if isinstance(msg, Crashed):
                raise msg.error(msg.message)
            if isinstance(msg, P.Error):
                raise WorkerJobError(msg.kind, msg.message, msg.excess_tokens)
            yield msg
            if isinstance(msg, (*P.FINAL, Cancelled)):
                return


def _end_status(job: Job, msg: Any) -> P.JobStatus:
    """The status a job's final message gives it. A job cancelled while running ends with the tail of
    its answer (a Result that says so) or, before its first token, with the worker's refusal."""
    if isinstance(msg, Cancelled):
        return P.JobStatus.CANCELLED
    if isinstance(msg, P.Result):
        return P.JobStatus.CANCELLED if msg.finish_reason == "cancelled" else P.JobStatus.FINISHED
    if isinstance(msg, P.Done):
        return P.JobStatus.FINISHED
    return P.JobStatus.CANCELLED if isinstance(msg, P.Error) and job.cancel_requested else P.JobStatus.FAILED


async def precompute(dispatcher: Any, message: P.PrecomputeJob, timeout: float | None = None) -> P.Done:
    """Run an ingestion batch on a dispatcher (a `JobBook` with a transport: submit, events and cancel)
    and return its Done."""
    job = dispatcher.submit(message)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        async for msg in dispatcher.events(job, deadline):
            if isinstance(msg, P.Done):
                return msg
    finally:
        dispatcher.cancel(job)
    raise WorkerCrashed("the job ended without a result")
