"""The engine core: queries and ingestion work in, outputs out, one step at a time; no transport.

In nano-vllm's shape (`LLMEngine.add_request / step`) and vLLM v1's (`EngineCore`: no I/O, one
interface over every transport): the service's local worker (a pipe) and fleet worker (Redis streams)
are transports that turn their messages into `add` / `add_ingest` / `abort` calls and the outputs into
their messages; `solo.generate` is a batch of one on a core of its own. Its parts, one file each:
- scheduler.py: which requests run this step (admission against the KV memory, prefill and ingest budgets),
  over requests.py's requests, their phases and the step's plan;
- kv_memory.py: where every running sequence's KV lives (one buffer at the budget, an extent each), and
  fused_cache.py a sequence's view of its extent;
- ledger.py: every KV byte the worker holds on its device, against that one budget;
- runner.py: how a decode step runs (one forward for the batch, each row over its own extent);
- outputs.py: what a step returns.

A step returns its outputs, as vLLM v1's `EngineCore.step` does (a list of Preempted / Admitted / Token /
Finished / Failed / Ingested, then one Stepped): send back the preemptible work a waiting query needs the
memory of (scheduler.py; the shadow checks are that class, added with `add(seq, preemptible=True)`,
their Sequence reset to be redone), admit what the scheduler allows (each admitted sequence loads its
chunks' KV straight into its extent); run the step's share of prefill (decoder layers of the prefilling
sequences admitted in earlier steps, oldest first; a completed prefill takes its first token); a piece of
ingestion when it is ingestion's turn; one batched decode step for every sequence past its prefill, its
tokens chosen on the device with one host copy. A sequence's prefill starts in the step after its
admission, so its Admitted output (the service's plan, the SSE `sources` event) reaches the transport
before the prefill runs, not with its first token (docs/DESIGN.md, "Decoding: the engine core").

A KV load whose transient KV (cold chunks computed at first use; a chunk samkv's prefill finds gone)
finds no room sends its request back to wait for it (ledger.NeedsRoom, Scheduler.requeue). Failures stay
with their sequence: a prefill or KV load that raises fails that request; a batched decode step that
raises is retried sequence by sequence, so only the rows that fail alone fail, and a row whose logits
are not finite (its prefill's or a decode step's) fails without its neighbours' tokens changing
(docs/DESIGN.md, "Decoding").

A request for n choices is fused once: its n - 1 other rows are reserved at admission (scheduler.py) and
forked from its prefill when that completes (`_fork`: a copy of the fused cache each, Sequence.fork);
every row then decodes with the batch. Outputs carry the request's id and the row's `index`; a row that
fails fails the whole request (one Failed), and an abort ends every row.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvfuse.fusion.engine import sampling
from kvfuse.fusion.engine.fused_cache import FusedCache
from kvfuse.fusion.engine.kv_memory import KVMemory, token_bytes_of
from kvfuse.fusion.engine.ledger import Carve, Ledger, NeedsRoom, carved_tokens
from kvfuse.fusion.engine.outputs import (
    Admitted,
    Cancelled,
    Emit,
    Failed,
    Finished,
    Ingested,
    Output,
    Preempted,
    Stepped,
    Token,
)
from kvfuse.fusion.engine.requests import IN_FLIGHT, Phase, Request, SchedulerLimits
from kvfuse.fusion.engine.runner import BLOCK, ModelRunner
from kvfuse.fusion.engine.scheduler import Scheduler
from kvfuse.fusion.engine.sequence import RequestId, Sequence
from kvfuse.fusion.errors import NonFiniteLogits

if TYPE_CHECKING:
    from kvfuse.config import Settings
    from kvfuse.fusion.engine.fusing import FusingEngine
    from kvfuse.fusion.engine.requests import IngestNeed, IngestPiece

log = logging.getLogger("kvfuse.fusion")


class EngineCore:
    """The engine over `engine` (kvfuse.fusion.FusionEngine, as engine/fusing.py names it) within `limits`.

    static / cuda_graphs: the runner's static decode path and its CUDA graphs (runner.py). carves: holders
    of device KV outside the buffer with caps of their own (the device tier): the buffer is the budget
    less their caps, so the one ledger (ledger.py) holds them all within `limits.kv_budget_tokens`."""

    def __init__(self, engine: FusingEngine, limits: SchedulerLimits, *, static: bool = False,
                 cuda_graphs: bool = False, carves: tuple[Carve, ...] = ()) -> None:
        self.engine = engine
        carved = carved_tokens(carves, token_bytes_of(engine.tf))
        capacity = limits.kv_budget_tokens - carved
        if static:  # the static path's mask reads whole key blocks: a whole number of them, within the budget
            capacity = capacity // BLOCK * BLOCK
        if capacity < (BLOCK if static else 1):
            beside = f" beside the {carved} tokens carved for {', '.join(c.kind for c in carves)}" if carves else ""
            raise ValueError(f"server.kv_budget_tokens ({limits.kv_budget_tokens}) leaves no KV memory{beside}"
                             + (f" (the static decode path needs whole {BLOCK}-token blocks)" if static else ""))
        self.memory = KVMemory.for_transformer(engine.tf, capacity, zeroed=static, align=BLOCK if static else 1)
        self.ledger = Ledger(self.memory, limits.kv_budget_tokens, carves, str(engine.device))
        self.runner = ModelRunner(engine.tf, self.memory, max_batch=limits.max_running, static=static,
                                  cuda_graphs=cuda_graphs)
        self.scheduler = Scheduler(limits, self.memory)
        self.step_no = 0
        self.forks: dict[RequestId, list[RequestId]] = {}  # a request of n > 1 -> its forked rows' ids
        self.ingest_kv_peak = 0  # the most tokens the memory held while an ingestion piece ran (<= its capacity)

    @classmethod
    def from_settings(cls, engine: FusingEngine, settings: Settings, carves: tuple[Carve, ...] = ()) -> EngineCore:
        """As kvfuse.config Settings say (server.* limits; the static path with CUDA graphs on a CUDA
        device when fusion.decode_cuda_graphs is on)."""
        graphs = settings.fusion.decode_cuda_graphs and engine.device.type == "cuda"
        return cls(engine, SchedulerLimits.from_settings(settings.server), static=graphs, cuda_graphs=graphs,
                   carves=carves)

    def warm_up(self) -> float:
        """Compile and capture what the decode step needs before the first request (seconds taken)."""
        return self.runner.warm_up()

    # -- state ------------------------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def fits(self, kv_tokens: int, rows: int = 1) -> bool:
        """Whether a request of this many KV tokens (for each of `rows` choices) could ever run here."""
        return self.scheduler.fits_alone(kv_tokens, rows)

    # -- arrivals ---------------------------------------------------------------------------------------------
    def add(self, seq: Sequence, *, preemptible: bool = False) -> None:
        """Queue a query under its `request_id` (ValueError when it could never fit the KV memory).
        preemptible: the scheduler's lowest class (a shadow check's full prefill, scheduler.py): admitted
        only while no query waits, preempted and redone when a query needs its memory; its prefill must
        read no stored KV on a loader thread (preemption frees the extent at once)."""
        self.scheduler.add(Request(seq.request_id, kv_tokens=seq.kv_tokens, prefill_tokens=seq.prefill_tokens,
                                   seq=seq, rows=seq.n, preemptible=preemptible))

    def private_id(self) -> RequestId:
        """An id for work of the worker's own (a shadow check): negative, so no transport's job has it."""
        return next(self.scheduler.row_ids)

    def add_ingest(self, job_id: RequestId, piece: IngestPiece, need: IngestNeed | None = None,
                   stop: Callable[[], None] | None = None) -> None:
        """Queue ingestion work: `piece(budget_tokens)` runs one turn of it and returns IN_FLIGHT while a
        piece is paused between decoder layers (resumed on the next turn), None when a piece ended and the
        work is not done, then its result (emitted as Ingested); `need(budget_tokens)`: the KV tokens the
        next piece's forward holds on the device, reserved in the memory from its first turn to its last
        (scheduler.py); `stop()`: abandon a piece in flight (the job was cancelled)."""
        self.scheduler.add_ingest(Request(job_id, piece=piece, need=need, stop=stop))

    def abort(self, job_id: RequestId) -> list[Output]:
        """Stop a request wherever it is; returns what that finished: a decoding one finishes as
        cancelled (its held-back text first), any other fails with Cancelled; an ingestion job is
        dropped (nothing)."""
        out: list[Output] = []
        for rid in [job_id, *self.forks.pop(job_id, [])]:  # a request of n > 1: every row
            req = self.scheduler.remove(rid)
            if req is None:
                continue
            if req.status is Phase.INGESTING:
                self._end_ingest(req, abandon=True)  # its piece in flight abandoned, its memory given back
                continue
            seq = _seq(req)
            if req.status is not Phase.DECODING:
                return [Failed(job_id, Cancelled("cancelled"))]  # not prefilled: no row was forked
            tail = seq.generation.cancel()
            out += [*([Token(job_id, tail, index=seq.index)] if tail else []), Finished(job_id, seq)]
        return out

    # -- the step ---------------------------------------------------------------------------------------------
    def step(self) -> list[Output]:
        """One step (the module docstring); returns its outputs, in the order they happened."""
        self.step_no += 1
        out: list[Output] = []
        emit = out.append
        sch = self.scheduler
        t0 = time.perf_counter()
        self.ledger.step_peak = 0
        plan = sch.schedule()
        for req in plan.preempted:
            seq = _seq(req)
            seq.reset()
            emit(Preempted(req.job_id, seq))
        for req in plan.admit:
            self._start(req, emit)
        self.ledger.observe()
        self._prefill(sch.limits.prefill_tokens_per_step * self.engine.num_layers, emit,
                      admitted={r.job_id for r in plan.admit}, low=plan.low_prefill)
        ingest_s = 0.0
        if plan.ingest is not None:
            t_ingest = time.perf_counter()
            self._ingest(plan.ingest, plan.ingest_tokens, plan.ingest_kv, emit)
            ingest_s = time.perf_counter() - t_ingest
        batch = sch.decode_batch()
        if batch:
            self._decode(batch, emit)
        took = time.perf_counter() - t0
        sch.spent(plan, ingest_s, took - ingest_s)  # ingestion's share is of time
        _, holders = self.ledger.observe()
        shadow = sch.num_low_running
        emit(Stepped(self.step_no, len(batch), [r.job_id for r in plan.admit],
                     plan.ingest.job_id if plan.ingest is not None else None, sch.num_running - shadow,
                     sch.num_waiting, sch.kv_used, self.memory.extent_bytes, took, shadow, holders,
                     self.ledger.step_peak))
        return out

    def _fail(self, job_id: RequestId, err: BaseException, emit: Emit) -> None:
        """A row failed: its request fails, every row of it retired (n > 1), one Failed."""
        req = self.scheduler.running.get(job_id)
        if req is None:  # already retired with a sibling row that failed in the same step
            return
        request = req.seq.request_id if req.seq is not None else job_id
        for rid in [request, *self.forks.pop(request, [])]:
            self.scheduler.retire(rid)
        emit(Failed(request, err))

    def _start(self, req: Request, emit: Emit) -> None:
        seq = _seq(req)
        if not req.announced:
            emit(Admitted(req.job_id, seq))
            req.announced = True
        extent = req.extent
        assert extent is not None  # an admitted request holds its extent

        def new_cache(capacity: int) -> FusedCache:  # the prefill's cache is the request's extent
            return FusedCache.in_memory(self.memory, extent, capacity)

        self.scheduler.load_starts(req.job_id)  # the room admission kept for the load is the load's now
        try:
            seq.start(self.engine, new_cache)
        except NeedsRoom as err:
            self._wait_for_room(req, err, emit)
        except Exception as err:  # noqa: BLE001 - fails this request only
            self._fail(req.job_id, err, emit)

    def _wait_for_room(self, req: Request, err: NeedsRoom, emit: Emit) -> None:
        """A load's transient KV (at its start, or a chunk samkv's prefill finds gone) does not fit now:
        the request is reset and waits at the head of the queue for that room (Scheduler.requeue); it
        fails only where the room could never be had."""
        _seq(req).reset()
        if not self.scheduler.requeue(req.job_id, err.tokens):
            self._fail(req.job_id, err, emit)

    def _prefill(self, budget: int, emit: Emit, admitted: set[RequestId], low: bool) -> None:
        """Advance the prefilling sequences, oldest first, by up to `budget` rows x layers in all; those
        `admitted` in this step wait for the next (their Admitted output goes out first). Preemptible ones
        come after every query and only when `low` (the plan's `low_prefill`)."""
        for req in self.scheduler.prefilling(low):
            if budget <= 0:
                return
            if req.job_id in admitted:
                continue
            seq = _seq(req)
            try:
                spent, text = seq.advance(self.engine, budget)
            except NeedsRoom as err:
                self._wait_for_room(req, err, emit)
                continue
            except Exception as err:  # noqa: BLE001 - fails this request only
                self._fail(req.job_id, err, emit)
                continue
            budget -= spent
            if text is not None:
                self.scheduler.prefilled(req.job_id, kv_tokens=seq.fused_cache.capacity)  # smaller if evicted
                rows = self._fork(req, emit) if seq.n > 1 else []
                for row, row_text in [(req, text), *rows]:
                    self._emit(row, row_text, emit)

    def _fork(self, req: Request, emit: Emit) -> list[tuple[Request, str]]:
        """A prefilled request's other choices (n > 1): each reserved row gets a copy of its fused cache
        and its first token from the same logits; (row, its first text) for each."""
        seq = _seq(req)
        rows = self.scheduler.fork(req.job_id)
        self.forks[req.job_id] = [r.job_id for r in rows]
        out = []
        try:
            for index, row in enumerate(rows, start=1):
                assert row.extent is not None  # a reserved row holds its extent
                row.seq, text = seq.fork(self.engine, index, seq.fused_cache.fork(self.memory, row.extent))
                out.append((row, text))
        except Exception as err:  # noqa: BLE001 - fails this request only
            self._fail(req.job_id, err, emit)
            return []
        seq.first_logits = None
        return out

    def _ingest(self, req: Request, budget_tokens: int, kv_tokens: int, emit: Emit) -> None:
        """One turn of an ingestion job, its piece's forward cache held as `kv_tokens` of the memory from
        the piece's first turn to its last (MemoryFull fails the job when it could never fit), read into
        the ledger's peaks while it runs."""
        assert req.piece is not None  # an ingestion request
        try:
            if kv_tokens > 0 and not req.held:
                self.memory.allocate(("ingest", req.job_id), kv_tokens, kind="ingest")
                req.held = kv_tokens
                self.ingest_kv_peak = max(self.ingest_kv_peak, self.memory.used_tokens)
            self.ledger.observe()
            done = req.piece(budget_tokens)
            self.ledger.observe()  # a piece may fill the device tier or the prefix cache
        except Exception as err:  # noqa: BLE001 - fails this job only
            self.scheduler.ingest_done(req.job_id)
            self._end_ingest(req, abandon=True)
            emit(Failed(req.job_id, err))
            return
        if done is IN_FLIGHT:
            return
        self._end_ingest(req)
        if done is not None:
            self.scheduler.ingest_done(req.job_id)
            emit(Ingested(req.job_id, done))

    def _end_ingest(self, req: Request, *, abandon: bool = False) -> None:
        """An ingestion piece ended: its forward's memory given back; with `abandon` (the job failed or
        was cancelled) the job's `stop` first, which abandons a piece still in flight."""
        if abandon and req.stop is not None:
            req.stop()
        self.memory.release(("ingest", req.job_id))
        req.held = 0

    def _decode(self, batch: list[Request], emit: Emit) -> None:
        """One step for every decoding sequence: one forward, the tokens chosen on the device for the whole
        batch and copied to the host once. Failing rows fail alone (the module docstring)."""
        seqs = [_seq(r) for r in batch]
        tokens = torch.tensor([s.generation.last_token for s in seqs], dtype=torch.long)
        try:
            logits = self.runner.decode([s.fused_cache for s in seqs], tokens)
        except Exception:  # noqa: BLE001 - find the rows that fail alone; the others keep their tokens
            log.warning("a batched decode step failed: retrying its %d sequences one by one", len(batch),
                        exc_info=True)
            self._decode_alone(batch, tokens, emit)
            return
        self._take(batch, logits, emit)

    def _decode_alone(self, batch: list[Request], tokens: torch.Tensor, emit: Emit) -> None:
        kept: list[Request] = []
        rows: list[torch.Tensor] = []
        for i, r in enumerate(batch):
            if r.job_id not in self.scheduler.running:  # its request failed with another of its rows
                continue
            try:
                rows.append(self.runner.decode([_seq(r).fused_cache], tokens[i : i + 1]))
                kept.append(r)
            except Exception as err:  # noqa: BLE001 - this sequence's own failure
                self._fail(r.job_id, err, emit)
        if kept:
            self._take(kept, torch.cat(rows), emit)

    def _take(self, batch: list[Request], logits: torch.Tensor, emit: Emit) -> None:
        finite = torch.isfinite(logits).all(dim=-1)
        safe = torch.where(finite[:, None], logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
        picked = sampling.choose(safe, [_seq(r).generation.sampling for r in batch])
        chosen, ok = picked.tolist(), finite.tolist()  # the one host sync
        for i, r in enumerate(batch):
            if r.job_id not in self.scheduler.running:  # its request failed with another of its rows
                continue
            if not ok[i]:
                self._fail(r.job_id, NonFiniteLogits(), emit)
                continue
            self._emit(r, _seq(r).accept_token(chosen[i], logits[i]), emit)

    def _emit(self, req: Request, text: str, emit: Emit) -> None:
        """A row's text (under its request's id and its choice index) and, when it ended, its Finished."""
        seq = _seq(req)
        gen = seq.generation
        if text:
            logprobs = gen.take_logprobs() if gen.options.logprobs is not None else None
            emit(Token(seq.request_id, text, logprobs, seq.index))
        if gen.finished is not None:
            self.scheduler.retire(req.job_id)
            family = self.forks.get(seq.request_id)
            if family is not None and not any(r in self.scheduler.running for r in [seq.request_id, *family]):
                del self.forks[seq.request_id]
            emit(Finished(seq.request_id, seq))


def _seq(req: Request) -> Sequence:
    """The Sequence of a query's request (every request but an ingestion job's has one)."""
    if req.seq is None:
        raise TypeError(f"request {req.job_id} is an ingestion job, not a query")
    return req.seq
