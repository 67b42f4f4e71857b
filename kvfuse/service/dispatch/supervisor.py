"""The API side of the worker: starts it, sends it jobs as they come, routes its replies, restarts it.

Every job goes to the worker at once (over a writer thread, so a busy worker never blocks the event
loop); the worker's scheduler decides when it runs, batching many queries into each decode step (see
`worker/core.py` and `wire/protocol.py` for the messages). Any number of jobs are in flight; replies are routed
by job id to each job's event queue (the book of jobs and counts is `job_book.JobBook`, shared with the
fleet's dispatcher).

Admission control lives here only as far as the API must answer at once: a query counts as waiting
from submission until the worker admits it (its Plan), and when `server.queue_size` queries wait the
next gets `QueueFull` (429). Cancelling a waiting query ends it here at once; a running one is stopped
by a Cancel message within one engine step (and, as a last resort, its worker is killed after
`server.worker_cancel_grace_s`).

When the worker dies every job it held that may have run ends with `WorkerCrashed` (a query past its
Plan, any precompute sent to it); queries it had not admitted yet are sent again to the new worker,
which starts at once (with a back-off only while starts keep failing). An ingestion whose precompute
ended so is tried again by its job, within `server.ingest_retry_attempts` (ingest_retry.py).

Starts that keep failing are bounded: after `server.worker_start_attempts` starts in a row that never
loaded the model (a load error the worker reports as Fatal, or a death before Ready: a crash loop), or
after two starts in a row that report the same load error (a refused model or a missing file fails the
same way every time: a third full load would only repeat it), the supervisor gives up
(`JobBook.give_up`): it logs why, every job ends with `WorkerFailed`, and the service is failed
(health.py), so a container that can never answer turns unhealthy instead of retrying forever. Every
route that needs the model then answers 503 `model_failed` with that reason (ServiceState.require_model).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue
import threading
from collections import deque
from multiprocessing.connection import wait
from typing import Any

from kvfuse.config import Settings
from kvfuse.service.dispatch.job_book import Cancelled, Crashed, Job, JobBook
from kvfuse.service.health import restart_delay_s
from kvfuse.service.metrics import Metrics
from kvfuse.service.wire import protocol as P
from kvfuse.service.worker.core import worker_main

log = logging.getLogger(__name__)


class WorkerSupervisor(JobBook):
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        super().__init__(settings, metrics)
        self.info: dict[str, Any] = {}
        self.ledger: dict[str, Any] = {}  # the worker's device KV ledger, as its latest step left it (/ready)
        self.last_error: str | None = None
        self._steps: deque[P.Step] = deque(maxlen=4096)  # the latest engine steps (tests, debugging)
        self._steps_lock = threading.Lock()  # appended by the reader thread, read from any other
        self.restarts = 0
        self._ctx = mp.get_context("spawn")
        self._proc: Any = None
        self._outbox: queue.SimpleQueue | None = None
        self._generation = 0
        self._sent: set[int] = set()  # of those, sent to the current worker
        self._failures = 0  # consecutive starts that never reached "ready"
        self._loaded = False  # the current worker sent Ready
        self._fatal: str | None = None  # the current worker's Fatal message (its load error)
        self._previous_fatal: str | None = None  # the load error of the start before, while starts fail
        self._loop: asyncio.AbstractEventLoop | None = None
        self._restart_task: asyncio.Task | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------
    @property
    def steps(self) -> list[P.Step]:
        """A snapshot of the latest engine steps, oldest first (safe while the worker keeps stepping)."""
        with self._steps_lock:
            return list(self._steps)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._spawn()

    async def stop(self) -> None:
        self._closing = True
        if self._restart_task is not None:
            self._restart_task.cancel()
        for job in list(self._jobs.values()):
            self._finish(job, Crashed("the service is shutting down"))
        proc, outbox = self._proc, self._outbox
        if proc is None:
            return
        if outbox is not None:
            outbox.put(P.Shutdown())
            outbox.put(None)
        await asyncio.to_thread(proc.join, self.settings.server.worker_stop_timeout_s)
        if proc.is_alive():
            proc.kill()
            await asyncio.to_thread(proc.join, 5)

    def _spawn(self) -> None:
        self._generation += 1
        gen = self._generation
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=worker_main, args=(self.settings, child), name="kvfuse-worker", daemon=True)
        proc.start()
        child.close()
        self._proc, self._outbox = proc, queue.SimpleQueue()
        self._sent = set()
        self._loaded, self._fatal = False, None
        log.info("worker started (pid %d)", proc.pid)
        threading.Thread(target=self._read, args=(gen, proc, parent), name=f"kvfuse-worker-reader-{gen}",
                         daemon=True).start()
        threading.Thread(target=self._write, args=(self._outbox, parent), name=f"kvfuse-worker-writer-{gen}",
                         daemon=True).start()

    @staticmethod
    def _write(outbox: queue.SimpleQueue, conn: Any) -> None:
        """Writer thread: sends queued messages in order (a send blocks while the worker is mid-step)."""
        while (msg := outbox.get()) is not None:
            try:
                conn.send(msg)
            except OSError:
                return  # the worker is gone; the reader reports it

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
        # The pipe closes when both threads are done with it (closing it here could pull the descriptor
        # from under a send in progress).
        self._loop.call_soon_threadsafe(self._on_exit, gen, proc.exitcode)

    def _on_message(self, gen: int, msg: Any) -> None:
        if gen != self._generation:
            return
        if isinstance(msg, P.Step):
            self._on_step(msg)
            return
        if isinstance(msg, P.SHADOW):
            self._on_shadow(msg)
            return
        if isinstance(msg, P.Ready):
            self.info = msg.info
            self.ledger = dict(msg.info.get("kv_ledger") or {})
            name = str(msg.info.get("name", ""))
            self.metrics.kv_budget_bytes.labels(name).set(msg.info.get("kv_budget_bytes", 0))
            self.metrics.engine_warmup.labels(name).set(msg.info.get("warmup_s", 0.0))
            self._failures, self._previous_fatal = 0, None
            self._loaded = True
            self.last_error = None
            self._ready.set()
            log.info("worker ready (pid %s, max context %s)", msg.info.get("pid"), msg.info.get("max_context_tokens"))
            for job in self._jobs.values():
                self._send(job)
            return
        if isinstance(msg, P.Fatal):
            self.last_error = self._fatal = msg.message
            log.error("worker failed to start: %s", self.last_error)
            return
        job = self._jobs.get(getattr(msg, "job_id", -1))
        if job is None:
            return  # a late message of a job already ended (cancelled, timed out)
        if isinstance(msg, P.Plan):
            self._started(job)
        if isinstance(msg, P.FINAL):
            self._count_usage(msg)
            self._finish(job, msg)
        else:
            job.events.put_nowait(msg)

    def _on_step(self, msg: P.Step) -> None:
        with self._steps_lock:
            self._steps.append(msg)
        if msg.batch_size:
            self.metrics.batch_size.observe(msg.batch_size)
        self.metrics.step_seconds.labels("ingest" if msg.ingest_job is not None else "query").observe(msg.seconds)
        name = str(self.info.get("name", ""))
        self.metrics.kv_pool_bytes.labels(name).set(msg.kv_bytes)
        if msg.ledger and self.ledger:
            peak = max(int(self.ledger.get("peak_bytes", 0)), msg.ledger_peak)
            self.ledger = {**self.ledger, "holders": dict(msg.ledger), "used_bytes": sum(msg.ledger.values()),
                           "peak_bytes": peak}
            self.metrics.ledger(name, self.ledger)
        if msg.ingest_job is not None and msg.ingest_job in self._jobs:
            self._started(self._jobs[msg.ingest_job])

    def _on_exit(self, gen: int, exitcode: int | None) -> None:
        if gen != self._generation:
            return
        self._ready.clear()
        if self._closing:
            return
        log.error("worker (pid %s) exited with code %s", self._proc.pid if self._proc else "?", exitcode)
        if self._outbox is not None:
            self._outbox.put(None)
        for job in list(self._jobs.values()):
            # A precompute the worker held may be what killed it: it is not resent here; its ingestion job
            # decides whether to try again (a bounded number of times, ingest_retry.py).
            if job.status is not P.JobStatus.WAITING or (job.kind == "precompute" and job.id in self._sent):
                self._finish(job, Crashed(f"the worker process died (exit code {exitcode})"))
        repeated = False
        if not self._loaded:
            self._failures += 1
            self.last_error = self._fatal or f"the worker exited with code {exitcode} before its model loaded"
            repeated = self._fatal is not None and self._fatal == self._previous_fatal
            self._previous_fatal = self._fatal
        if repeated or self._failures >= self.settings.server.worker_start_attempts:
            again = " with the same load error" if repeated else ""
            reason = f"the model worker failed {self._failures} starts in a row{again}; the last: {self.last_error}"
            log.error("giving up on the model worker: %s", reason)
            self.give_up(reason)
            return
        self.metrics.worker_restarts.inc()
        self.restarts += 1
        self._restart_task = asyncio.create_task(self._restart())

    async def _restart(self) -> None:
        # Back off only when starts keep failing (a bad model path); a crash after a healthy run restarts now.
        await asyncio.sleep(restart_delay_s(self._failures))
        if not self._closing:
            self._spawn()

    def kill_worker(self) -> None:
        """Kill the worker (it will be restarted); used when a cancelled job does not stop."""
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()

    # -- jobs ----------------------------------------------------------------------------------------------
    def _send(self, job: Job) -> None:
        if job.id in self._sent or not self._ready.is_set() or self._outbox is None:
            return  # sent when the (next) worker is ready
        self._sent.add(job.id)
        self._outbox.put(job.message)

    def live_workers(self) -> list[dict[str, Any]]:
        if not self.ready:
            return []
        return [{"id": self.info.get("name"), "pid": self.pid, "device": self.settings.model.device,
                 "fingerprint": self.info.get("fingerprint"), "prompt": self.info.get("prompt"),
                 "running": self.running, "waiting": self.waiting, "kv_ledger": self.ledger}]

    def submit(self, message: P.QueryJob | P.PrecomputeJob) -> Job:
        """Hand a job to the worker; raises QueueFull when `server.queue_size` queries already wait."""
        job = self._register(message)
        self._send(job)
        return job

    def cancel(self, job: Job) -> None:
        """Cancel a job: ended at once if not started, stopped within one engine step if running."""
        if job.status.ended or job.cancel_requested:
            return
        job.cancel_requested = True
        if job.id in self._sent and self._outbox is not None:
            self._outbox.put(P.Cancel(job.id))
        if job.status is P.JobStatus.WAITING:
            self._finish(job, Cancelled())
            return
        assert self._loop is not None
        self._loop.call_later(self.settings.server.worker_cancel_grace_s, self._enforce_cancel, job)

    def _enforce_cancel(self, job: Job) -> None:
        if job.id in self._jobs and not job.status.ended:
            log.error("job %d ignored its cancellation for %.0f s: killing the worker", job.id,
                      self.settings.server.worker_cancel_grace_s)
            self.kill_worker()
