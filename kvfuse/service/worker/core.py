"""The worker process: owns the LLM (FusionEngine), reads and writes chunk KV in the store itself, and
serves many queries at once with a batching engine loop.

It runs in its own OS process (spawn), so a crash or a hung kernel never takes the API down, and the API
process never imports the model. Messages over the pipe are the dataclasses of `protocol.py` and carry
only chunk keys, token ids and options: KV bytes never cross it (LMDB is memory-mapped and both
processes open it).

Protocol: the API sends QueryJob / PrecomputeJob as they arrive (any number in flight), Cancel(job_id)
to stop one, Shutdown to end. The worker answers Ready once loaded (or Fatal, then exits). A query gets
an Error at once if it can never run (context or KV budget); otherwise it waits in the scheduler and,
when admitted, gets Plan (the chunks that fit), then Delta messages as its text grows, then one Result.
A precompute job gets one Done (or Error). After every engine step the worker sends Step (batch size,
queue depths), and every message names the step it came from.

The loop (`serve`): drain the pipe (blocking only when idle), then one engine step: admit what the
scheduler allows (send Plan, load KV), run the step's share of prefill (decoder layers of the prefilling
sequences, oldest first; a completed prefill takes its first token), a piece of ingestion if it is
ingestion's turn, then one batched decode step for every sequence past its prefill; finished, cancelled and failed sequences are
retired at once, so a Cancel read at the top of a step takes effect in that step. When the scheduler
has nothing to do, the loop runs shadow checks of finished queries a slice at a time, reading the pipe
between slices (shadow.py): a ShadowResult (or ShadowDropped) goes to the API for its fidelity ledger.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import traceback
from multiprocessing.connection import Connection
from typing import Any

from kvfuse.config import Settings
from kvfuse.service.wire import protocol as P
from kvfuse.service.wire.protocol import (
    ERR_CONTEXT_OVERFLOW,
    ERR_INDEX_UNAVAILABLE,
    ERR_INTERNAL,
    ERR_INVALID,
)
from kvfuse.service.worker.chunk_kv import ChunkCache
from kvfuse.service.worker.scheduler import Request, Scheduler, SchedulerLimits
from kvfuse.service.worker.sequences import IngestTask, QuerySequence, plan_query
from kvfuse.service.worker.shadow import ShadowChecks

log = logging.getLogger("kvfuse.worker")

class Worker:
    SHARE_REBUILT = False  # a fleet worker writes a chunk rebuilt on a miss back to the shared tiers

    def __init__(self, settings: Settings, conn: Connection) -> None:
        from kvfuse.fusion import FusionEngine
        from kvfuse.fusion.model_runner import DecodeRunner

        self.settings = settings
        self.conn = conn
        self.name = settings.fleet.worker_name or f"{socket.gethostname()}-{os.getpid()}"
        self.engine = FusionEngine.from_settings(settings)
        self.store = self.open_store(settings)
        self.kv = ChunkCache(self.engine, self.store, settings, share_rebuilt=self.SHARE_REBUILT)
        self.max_context = self.engine.max_context_tokens  # the model's limit, lowered by the setting
        self.scheduler = Scheduler(SchedulerLimits.from_settings(settings.server))
        # The running sequences' KV once their prefill is complete, and the batched step over it.
        self.decoder = DecodeRunner.from_settings(self.engine.tf, settings.fusion)
        self.step_no = 0
        # Shadow checks run only when the scheduler is idle, a slice at a time (shadow.py).
        self.shadow = ShadowChecks(settings.fidelity, self.engine)

    # -- helpers -------------------------------------------------------------------------------------------
    def open_store(self, settings: Settings) -> Any:
        """The chunk store this worker reads and writes (a fleet worker adds the shared tier)."""
        from kvfuse.store import KVStore

        return KVStore.open(settings, require_index=False)

    def send(self, msg: Any) -> None:
        if isinstance(msg, P.Result | P.Done):
            msg.worker = self.name
        self.conn.send(msg)

    def info(self) -> dict:
        from kvfuse.fusion import available_methods

        e = self.engine
        return {"name": self.name, "pid": os.getpid(), "fingerprint": e.fingerprint, "max_context_tokens": self.max_context,
                "num_layers": e.num_layers, "num_kv_heads": e.num_kv_heads, "head_dim": e.head_dim,
                "methods": list(available_methods()), "kv_dtype": self.kv.kv_dtype,
                "kv_budget_tokens": self.scheduler.limits.kv_budget_tokens,
                "max_running_requests": self.scheduler.limits.max_running}

    def _error(self, job_id: int, err: BaseException) -> P.Error:
        from kvfuse.store.errors import IndexUnavailableError

        if isinstance(err, IndexUnavailableError):
            # What LMDB holds is written; the index (Redis) catches up when it answers: the API retries.
            log.warning("job %d: the document index is unavailable: %s", job_id, err)
            return P.Error(job_id, ERR_INDEX_UNAVAILABLE, str(err), None, self.step_no)
        if isinstance(err, ValueError | TypeError):
            # UnknownMethodError / ContextOverflowError are ValueErrors: the request was not servable.
            log.warning("job %d refused: %s", job_id, err)
            excess = getattr(err, "excess_tokens", None)
            kind = ERR_CONTEXT_OVERFLOW if excess is not None else ERR_INVALID
            return P.Error(job_id, kind, str(err), excess, self.step_no)
        log.error("job %d failed: %s", job_id, traceback.format_exc())
        return P.Error(job_id, ERR_INTERNAL, f"{type(err).__name__}: {err}", None, self.step_no)

    # -- arrivals ------------------------------------------------------------------------------------------
    def receive(self, msg: Any) -> bool:
        """Handle one message from the API; False on Shutdown."""
        if isinstance(msg, P.Shutdown):
            return False
        try:
            if isinstance(msg, P.QueryJob):
                req = plan_query(msg, self.engine, self.scheduler, self.max_context, self.step_no)
                if isinstance(req, P.Error):
                    self.send(req)
                else:
                    self.scheduler.add(req)
                    self.shadow.watch(req.data)
            elif isinstance(msg, P.PrecomputeJob):
                self.scheduler.add_ingest(Request(msg.job_id, data=IngestTask(msg)))
            elif isinstance(msg, P.Cancel):
                self.cancel(msg.job_id)
            else:
                self.send(P.Error(getattr(msg, "job_id", 0), ERR_INTERNAL, f"unknown message {type(msg).__name__}"))
        except Exception as err:  # noqa: BLE001 - a bad job must not kill the worker
            self.send(self._error(getattr(msg, "job_id", 0), err))
        return True

    def cancel(self, job_id: int) -> None:
        req = self.scheduler.remove(job_id)
        if req is None:
            return  # already ended
        self.decoder.pool.release(job_id)
        if req.status is P.JobStatus.DECODING:
            seq: QuerySequence = req.data
            tail = seq.gen.cancel()
            if tail:
                self.send(P.Delta(job_id, tail, self.step_no))
            self.send(seq.result(self.step_no))
        else:  # no token yet: nothing to report but the end
            self.send(P.Error(job_id, ERR_INVALID, "cancelled", None, self.step_no))

    # -- the engine step -------------------------------------------------------------------------------------
    def step(self) -> None:
        self.step_no += 1
        plan = self.scheduler.schedule()
        for req in plan.admit:
            self._start(req)
        self._prefill(self.scheduler.limits.prefill_tokens_per_step * self.engine.num_layers)
        if plan.ingest is not None:
            self._ingest(plan.ingest, plan.ingest_tokens)
        batch = self.scheduler.decode_batch()
        if batch:
            self._decode(batch)
        self.send(P.Step(self.step_no, len(batch), [r.job_id for r in plan.admit],
                         plan.ingest.job_id if plan.ingest is not None else None, self.scheduler.num_running,
                         self.scheduler.num_waiting, self.scheduler.kv_used))

    def _start(self, req: Request) -> None:
        seq: QuerySequence = req.data
        self.send(seq.plan_message(self.step_no))
        try:
            seq.start(self.engine, self.kv)
        except Exception as err:  # noqa: BLE001 - fails this request only
            self._retire(req.job_id)
            self.send(self._error(req.job_id, err))

    def _retire(self, job_id: int) -> None:
        """A running request ended (finished, failed): its KV budget and its pool slot are free."""
        self.scheduler.retire(job_id)
        self.decoder.pool.release(job_id)

    def _prefill(self, budget: int) -> None:
        """Advance the prefilling sequences, oldest first, by up to `budget` rows x layers in all; a
        sequence whose prefill completes takes its first token and joins this step's decode batch."""
        for req in self.scheduler.prefilling():
            if budget <= 0:
                return
            seq: QuerySequence = req.data
            try:
                spent, text = seq.advance(self.engine, budget)
                if text is not None and seq.gen.finished is None:
                    self.decoder.pool.admit(req.job_id, seq.cache)  # decodes from the pool from now on
            except Exception as err:  # noqa: BLE001 - fails this request only
                self._retire(req.job_id)
                self.send(self._error(req.job_id, err))
                continue
            budget -= spent
            if text is not None:
                self.scheduler.prefilled(req.job_id, kv_tokens=seq.cache.capacity)  # smaller if evicted
                seq.cache = None  # its KV was copied into the pool
                self._emit(req, text)

    def _decode(self, batch: list[Request]) -> None:
        """One step for every sequence in the pool (the decoding requests, in slot order): one forward,
        the tokens chosen on the device for the whole batch and copied to the host once."""
        import torch

        from kvfuse.fusion.engine import sampling

        by_job = {r.job_id: r for r in batch}
        try:
            order = [by_job[owner] for owner in self.decoder.pool.owners]
            if len(order) != len(batch):
                raise RuntimeError(f"{len(batch)} decoding requests but {len(order)} pool slots")
            seqs: list[QuerySequence] = [r.data for r in order]
            tokens = torch.tensor([s.gen.last_token for s in seqs], dtype=torch.long)
            logits = self.decoder.step(tokens)
            chosen = sampling.choose(logits, [s.gen.sampling for s in seqs]).tolist()  # the one host sync
        except Exception as err:  # noqa: BLE001 - the batch's sequences fail; the worker goes on
            for r in batch:
                self._retire(r.job_id)
                self.send(self._error(r.job_id, err))
            return
        for i, r in enumerate(order):
            self._emit(r, r.data.accept_token(chosen[i], logits[i]))

    def _emit(self, req: Request, text: str) -> None:
        seq: QuerySequence = req.data
        if text:
            logprobs = seq.gen.take_logprobs() if seq.gen.options.logprobs is not None else None
            self.send(P.Delta(req.job_id, text, self.step_no, logprobs))
        if seq.gen.finished is not None:
            self._retire(req.job_id)
            self.send(seq.result(self.step_no))
            for msg in self.shadow.offer(seq, self.step_no):
                self.send(msg)

    def _ingest(self, req: Request, budget_tokens: int) -> None:
        task: IngestTask = req.data
        try:
            done = task.run_piece(self.kv, budget_tokens)
        except Exception as err:  # noqa: BLE001 - fails this job only
            self.scheduler.ingest_done(req.job_id)
            self.send(self._error(req.job_id, err))
            return
        if done is not None:
            self.scheduler.ingest_done(req.job_id)
            done.step = self.step_no
            self.send(done)

    def shadow_slice(self) -> None:
        """One slice of shadow work (the worker is idle); a check that ends sends its verdict."""
        try:
            verdict = self.shadow.run_slice(self.step_no)
        except Exception:  # noqa: BLE001 - a failed check is logged and dropped; queries go on
            log.error("shadow check failed: %s", traceback.format_exc())
            self.shadow.abandon()
            return
        if verdict is not None:
            self.send(verdict)

    def serve(self) -> None:
        self.send(P.Ready(self.info()))
        while True:
            # Block only when idle; pending shadow work is polled between its slices.
            timeout = 0.0 if self.scheduler.has_work or self.shadow.pending else None
            try:
                while self.conn.poll(timeout):
                    if not self.receive(self.conn.recv()):
                        return
                    timeout = 0.0
            except EOFError:
                return  # the API went away
            if self.scheduler.has_work:
                self.step()
            elif self.shadow.pending:
                self.shadow_slice()


def worker_main(settings: Settings, conn: Connection) -> None:
    """Entry point of the worker process."""
    # Ctrl-C in a terminal reaches the whole process group: the API decides when the worker stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s worker: %(message)s")
    try:
        worker = Worker(settings, conn)
    except Exception as err:  # noqa: BLE001 - reported to the API, which decides to retry
        log.error("worker failed to start: %s", traceback.format_exc())
        with contextlib.suppress(OSError):
            conn.send(P.Fatal(f"{type(err).__name__}: {err}"))
        return
    try:
        worker.serve()
    finally:
        worker.store.close()
