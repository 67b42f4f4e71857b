"""The worker: the engine core (kvfuse/fusion/engine/core.py) behind the wire protocol, with the chunk
KV of this process's store and the shadow checks of finished queries. No transport: a message in is a
call (`receive`), messages out go to the `send` the transport gives, so the whole worker runs in a test
as it runs in a process. Two transports use it: the local worker process over a pipe (`worker_main`,
below) and the fleet worker over Redis streams (fleet_worker.py).

It owns the LLM (FusionEngine) and opens the store itself (LMDB is memory-mapped), so KV bytes never
cross the transport: messages carry only chunk keys, token ids and options.

Protocol: QueryJob / PrecomputeJob arrive (any number in flight), Cancel(job_id) stops one, Shutdown
ends. Ready is sent once loaded (or Fatal). A query gets an Error at once if it can never run (context
or KV memory); otherwise it waits in the engine and, when admitted, gets Plan (the chunks that fit),
then Delta messages as its text grows, then one Result. A precompute job gets one Done (or Error).
After every engine step the worker sends Step (batch size, queue depths, KV memory held), and every
message names the step it came from. Shadow checks of finished queries (shadow.py) run on the same
engine core, as its lowest, preemptible class: their outputs stay here, and a check's ShadowResult (or a
ShadowDropped) goes to the API's fidelity ledger.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
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
from kvfuse.service.worker.sequences import DeferredChunks, IngestTask, plan_query
from kvfuse.service.worker.shadow import ShadowChecks

log = logging.getLogger("kvfuse.worker")


class WorkerCore:
    """The engine core and what it serves with. `store`: the chunk store (a fleet worker's adds the
    shared tier); `share_rebuilt`: a chunk rebuilt on a miss goes back to the store (a fleet's chunk is
    every host's)."""

    def __init__(self, settings: Settings, send: Callable[[Any], None], *, store: Any = None,
                 share_rebuilt: bool = False) -> None:
        from kvfuse.fusion import FusionEngine
        from kvfuse.fusion.engine.core import EngineCore

        self.settings = settings
        self.send_out = send
        self.name = settings.fleet.worker_name or f"{socket.gethostname()}-{os.getpid()}"
        self.engine = FusionEngine.from_settings(settings)
        if store is None:
            from kvfuse.store import KVStore

            store = KVStore.open(settings, require_index=False)
        self.store = store
        self.kv = ChunkCache(self.engine, self.store, settings, share_rebuilt=share_rebuilt)
        self.max_context = self.engine.max_context_tokens  # the model's limit, lowered by the setting
        self.core = EngineCore.from_settings(self.engine, settings, carves=device_carves(self.store))
        self.kv.hold_in(self.core.ledger)  # the system prompts' KV and the loads in the one ledger too
        self.warmup_s = self.core.warm_up()
        from kvfuse.fusion.engine.grammar import ll_tokenizer

        ll_tokenizer(self.engine.tokenizer, self.engine.stop_token_ids)  # response_format's, made once (grammar.py)
        self.shadow = ShadowChecks(settings.fidelity, self.engine, self.core)  # on the core, preemptible
        self._deferring: set[str] = set()  # keys of cold chunks a deferred computation holds (`defer`)
        self._deferred_jobs: set[int] = set()  # the ids of those computations (the core's private ids)

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    @property
    def step_no(self) -> int:
        return self.core.step_no

    @property
    def has_work(self) -> bool:
        return self.core.has_work

    def send(self, msg: Any) -> None:
        if isinstance(msg, P.Result | P.Done):
            msg.worker = self.name
        self.send_out(msg)

    def info(self) -> dict:
        from kvfuse.fusion import available_methods

        e, memory = self.engine, self.core.memory
        return {"name": self.name, "pid": os.getpid(), "fingerprint": e.fingerprint, "max_context_tokens": self.max_context,
                "num_layers": e.num_layers, "num_kv_heads": e.num_kv_heads, "head_dim": e.head_dim,
                "methods": list(available_methods()), "kv_dtype": self.kv.kv_dtype,
                "kv_budget_tokens": self.scheduler.capacity, "kv_budget_bytes": memory.nbytes,
                "max_running_requests": self.scheduler.limits.max_running, "warmup_s": self.warmup_s,
                "decode_path": "static" if self.core.runner.static else "eager",
                "prompt": {"style": e.prompt_style.name, "why": e.prompt_style.why},
                "kv_ledger": self.core.ledger.report().as_dict()}

    def error(self, job_id: int, err: BaseException) -> P.Error:
        from kvfuse.fusion.engine.ledger import NeedsRoom
        from kvfuse.fusion.engine.outputs import Cancelled
        from kvfuse.store.errors import IndexUnavailableError

        if isinstance(err, Cancelled):  # no token yet: nothing to report but the end
            return P.Error(job_id, ERR_INVALID, "cancelled", None, self.step_no)
        if isinstance(err, NeedsRoom):  # its load's transient KV could never fit beside its extent
            return P.Error(job_id, P.ERR_KV_BUDGET, f"{err}: raise server.kv_budget_tokens or lower max_tokens",
                           err.tokens, self.step_no)
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
        log.error("job %d failed: %s", job_id, "".join(traceback.format_exception(err)))
        return P.Error(job_id, ERR_INTERNAL, f"{type(err).__name__}: {err}", None, self.step_no)

    # -- arrivals ------------------------------------------------------------------------------------------
    def receive(self, msg: Any) -> bool:
        """Handle one message from the API; False on Shutdown."""
        if isinstance(msg, P.Shutdown):
            return False
        try:
            if isinstance(msg, P.QueryJob):
                seq = plan_query(msg, self.engine, self.core, self.max_context, self.step_no, self.kv)
                if isinstance(seq, P.Error):
                    self.send(seq)
                else:
                    self.core.add(seq)
                    self.shadow.watch(seq)
                    self.defer(seq.deferred)
            elif isinstance(msg, P.PrecomputeJob):
                task = IngestTask(msg, self.settings.server.ingest_layers_per_step)
                self.core.add_ingest(msg.job_id, lambda budget, task=task: task.run_piece(self.kv, budget),
                                     lambda budget, task=task: task.need(self.kv, budget), task.stop)
            elif isinstance(msg, P.Cancel):
                for out in self.core.abort(msg.job_id):
                    self._on_output(out)
            else:
                self.send(P.Error(getattr(msg, "job_id", 0), ERR_INTERNAL, f"unknown message {type(msg).__name__}"))
        except Exception as err:  # noqa: BLE001 - a bad job must not kill the worker
            self.send(self.error(getattr(msg, "job_id", 0), err))
        return True

    def defer(self, chunks: list[P.ChunkRef]) -> None:
        """Compute, at ingestion's share of the engine steps, the cold chunks of a query answered by a full
        prefill instead (sequences.plan_query), so the next query over them reads them: an ingestion job of
        the worker's own (a private id: nothing is reported to the API) of those not already deferred
        (`DeferredChunks`)."""
        todo = [c for c in chunks if c.key not in self._deferring]
        if todo:
            job_id = self.core.private_id()
            self._deferred_jobs.add(job_id)
            task = DeferredChunks(todo, self._deferring, self.settings.server.ingest_layers_per_step)
            self.core.add_ingest(job_id, lambda budget: task.run_piece(self.kv, budget),
                                 lambda budget: task.need(self.kv, budget), task.stop)

    # -- the engine step -------------------------------------------------------------------------------------
    def step(self) -> None:
        """One engine step; its outputs go out as the wire's messages, its Step with the step's wall time
        (what a query waits per step while ingestion shares the engine: DESIGN, "Bounded under load")."""
        for out in self.core.step():
            self._on_output(out)

    def _on_output(self, out: Any) -> None:
        """An engine output as the wire's message(s)."""
        from kvfuse.fusion.engine import outputs as E

        job_id = getattr(out, "job_id", None)
        if job_id is not None and self.shadow.owns(job_id):  # the shadow check's own: only its verdict goes out
            for msg in self.shadow.on_output(out, self.step_no):
                self.send(msg)
            return
        if isinstance(out, E.Token):
            self.send(P.Delta(out.job_id, out.text, self.step_no, out.logprobs, out.index))
        elif isinstance(out, E.Admitted):
            self.send(out.seq.plan_message(self.step_no))
        elif isinstance(out, E.Finished):
            query = out.seq.parent or out.seq  # n > 1: one Result once every row has finished
            if not query.finished_row(out.seq):
                return
            self.send(query.result(self.step_no))
            for msg in self.shadow.offer(query, self.step_no):  # choice 0's answer: one check per query
                self.send(msg)
        elif isinstance(out, E.Failed | E.Ingested) and out.job_id in self._deferred_jobs:
            self._deferred_jobs.discard(out.job_id)  # a deferred computation ended: its query was answered
            if isinstance(out, E.Failed):
                log.error("deferred chunk computation failed: %s", "".join(traceback.format_exception(out.error)))
        elif isinstance(out, E.Failed):
            self.send(self.error(out.job_id, out.error))
        elif isinstance(out, E.Ingested):
            out.value.step = self.step_no
            self.send(out.value)
        elif isinstance(out, E.Stepped):
            self.send(P.Step(out.step, out.batch, out.admitted, out.ingest, out.running, out.waiting, out.kv_tokens,
                             kv_bytes=out.kv_bytes, seconds=round(out.seconds, 6), shadow=out.shadow,
                             ledger=out.ledger, ledger_peak=out.ledger_peak))


def device_carves(store: Any) -> tuple[Any, ...]:
    """The store's holders of KV on the model's device beside the engine's buffer, as the ledger's carves:
    the device tier (store.device_tier_mb), its cap its own budget and its eviction its own."""
    from kvfuse.fusion.engine.ledger import Carve

    tier = getattr(store, "device_tier", None)
    if tier is None:
        return ()
    return (Carve("device_tier", tier.budget_bytes, lambda: int(tier.stats()[f"{tier.name}_bytes"])),)


def serve_pipe(worker: WorkerCore, conn: Connection) -> None:
    """The local transport: read the pipe (blocking only when idle), then one engine step."""
    worker.send(P.Ready(worker.info()))
    while True:
        timeout = 0.0 if worker.has_work else None
        try:
            while conn.poll(timeout):
                if not worker.receive(conn.recv()):
                    return
                timeout = 0.0
        except EOFError:
            return  # the API went away
        if worker.has_work:
            worker.step()


def worker_main(settings: Settings, conn: Connection) -> None:
    """Entry point of the local worker process."""
    # Ctrl-C in a terminal reaches the whole process group: the API decides when the worker stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s worker: %(message)s")
    t = time.perf_counter()
    try:
        worker = WorkerCore(settings, conn.send)
    except Exception as err:  # noqa: BLE001 - reported to the API, which decides to retry
        log.error("worker failed to start: %s", traceback.format_exc())
        with contextlib.suppress(OSError):
            conn.send(P.Fatal(f"{type(err).__name__}: {err}"))
        return
    log.info("worker ready in %.1f s (decode warm-up %.1f s); prompt style %s: %s", time.perf_counter() - t,
             worker.warmup_s, worker.engine.prompt_style.name, worker.engine.prompt_style.why)
    try:
        serve_pipe(worker, conn)
    finally:
        worker.store.close()
