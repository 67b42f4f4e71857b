"""The worker's side of a job: a query planned from its wire message, and an ingestion job in pieces.

A query is checked on arrival (does it fit the context and the KV memory at all?) and planned (which
retrieved chunks fit); it becomes the engine's Sequence (kvfuse/fusion/engine/sequence.py), which loads
its chunk KV from this worker's store on admission (`QuerySequence.load_kv`) and reports back in the
wire's messages (`plan_message`, `result`). A query for n choices is one sequence fused once; its other
rows are forked by the engine core and their ends gathered into one Result (`Choices`). An ingestion job is precomputed a piece at a time (up to the
step's token budget), so a large document shares the worker with running queries instead of holding it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Iterable
from typing import TYPE_CHECKING, Any

from kvfuse.fusion.engine.requests import IN_FLIGHT, InFlight
from kvfuse.fusion.engine.sequence import Sequence
from kvfuse.fusion.steps import advance
from kvfuse.service.wire import protocol as P
from kvfuse.service.worker import reload_policy as policy

if TYPE_CHECKING:
    from kvfuse.fusion.engine.core import EngineCore
    from kvfuse.service.worker.chunk_kv import ChunkCache


def plan_query(job: P.QueryJob, engine: Any, core: EngineCore, limit: int, step: int,
               kv: ChunkCache) -> QuerySequence | P.Error:
    """The engine sequence of a query, or the Error that refuses it (it could never run): `limit` is the
    worker's context in tokens, `step` the engine step it arrived in, `kv` where its chunks' KV is read."""
    from kvfuse.fusion import FusionOptions, GenerationOptions
    from kvfuse.fusion.methods import get_method
    from kvfuse.fusion.prompt import overflow

    fusion = FusionOptions(**job.fusion)
    gen = GenerationOptions(**job.generation)
    method = get_method(fusion.method)  # unknown method -> ValueError -> 422
    full_prefill, per_chunk = method.full_prefill, method.tokens_per_chunk(fusion)
    if gen.max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    names = [c.name for c in job.chunks]
    layout = "labelled" if any(names) else "plain"
    prefix_ids, question_ids = engine.prompt_parts(job.question, job.system_prompt, names, layout, job.history)
    fixed = len(prefix_ids) + len(question_ids) + gen.max_tokens
    too_long = overflow(len(prefix_ids) + len(question_ids), gen.max_tokens, limit)
    if too_long:
        return P.Error(job.job_id, P.ERR_MAX_TOKENS, too_long, fixed - limit, step)
    chunks = job.chunks
    budget = limit - fixed
    kept = list(range(len(chunks)))
    dropped: list[int] = []
    cost = [len(c.token_ids) + per_chunk for c in chunks]  # a chunk and the rows its method adds after it
    total = sum(cost)
    if total > budget:
        if job.explicit:
            return P.Error(job.job_id, P.ERR_CONTEXT_OVERFLOW,
                           f"the requested documents ({total} tokens) do not fit the model context: "
                           f"{total - budget} tokens too many beside the prompt and max_tokens "
                           f"({limit} tokens in all)", total - budget, step)
        for i in sorted(kept, key=lambda i: chunks[i].score):  # drop the lowest-scored first
            if total <= budget:
                break
            dropped.append(i)
            total -= cost[i]
        gone = set(dropped)
        kept = [i for i in kept if i not in gone]
        if layout != "plain":  # the kept chunks are numbered from 1 again
            question_ids = engine.prompt_parts(job.question, job.system_prompt, [names[i] for i in kept], layout,
                                             job.history)[1]
    kv_tokens = fixed + total
    # Prefill work: a full prefill runs every prompt token; a fusion method mainly its recomputed rows.
    prompt = len(prefix_ids) + total + len(question_ids)
    prefill = prompt if full_prefill else int(fusion.recompute_ratio * total) + len(question_ids)
    deferred: list[P.ChunkRef] = []
    if not full_prefill and not method.own_pipeline and fusion.cold_chunks != "compute":
        # Chunks with a recorded context only (first use, evictions): one whose context is not known (a
        # record from before contexts were recorded) is computed alone and never kept, as before.
        # The rule is monotone in the cold chunks' cost: where even all of them cold would not switch, no
        # tier is asked (the load asks again anyway), so chunks cached alone cost no lookup on arrival.
        wanted = [chunks[i] for i in kept]
        known = [c for c in wanted if c.context is not None]
        plain = sum(len(c.token_ids) for c in wanted)  # the context a full prefill runs: no method rows
        whole = len(prefix_ids) + plain + len(question_ids)
        could = policy.full_prefill_first(fusion.cold_chunks, sum(map(_cost, known)), prefill, whole)
        cold = [known[i] for i in kv.cold([(c.key, c.token_ids, c.context) for c in known])] if could else []
        if policy.full_prefill_first(fusion.cold_chunks, sum(map(_cost, cold)), prefill, whole):
            fusion = dataclasses.replace(fusion, method="vanilla")  # vanilla: the reference fusion approximates
            full_prefill, total, prompt, prefill, kv_tokens = True, plain, whole, whole, fixed + plain
            deferred = cold
    kv_budget = core.scheduler.capacity
    if job.n > 1 and not core.fits(kv_tokens, job.n):
        rows = core.scheduler.limits.max_running
        return P.Error(job.job_id, P.ERR_CHOICES,
                       f"n={job.n} choices of {kv_tokens} KV tokens each (prompt plus max_tokens) need "
                       f"{job.n * kv_tokens} tokens and {job.n} batch rows; the server holds {kv_budget} tokens "
                       f"(server.kv_budget_tokens) and {rows} rows (server.max_running_requests): lower n or "
                       "max_tokens", job.n * kv_tokens - kv_budget, step)
    if not core.fits(kv_tokens):
        return P.Error(job.job_id, P.ERR_KV_BUDGET,
                       f"the prompt plus max_tokens ({kv_tokens} tokens) exceed the server's KV budget of "
                       f"{kv_budget} tokens (server.kv_budget_tokens, less store.device_tier_mb's share): lower "
                       "max_tokens or use fewer documents",
                       kv_tokens - kv_budget, step)
    seq = QuerySequence(job, prefix_ids, question_ids, kept, dropped, total, fusion, gen, full_prefill, kv,
                        kv_tokens=kv_tokens, prefill_tokens=prefill, n=job.n)
    seq.deferred, seq.cold_full_prefill = deferred, fusion.method != method.name
    return seq


class QuerySequence(Sequence):
    """A query of the wire protocol in the engine: its chunks' KV read from this worker's store."""

    def __init__(self, job: P.QueryJob, prefix_ids: list[int], question_ids: list[int], kept: list[int],
                 dropped: list[int], context_tokens: int, fusion: Any, gen: Any, full_prefill: bool, kv: ChunkCache,
                 *, kv_tokens: int, prefill_tokens: int, n: int = 1) -> None:
        super().__init__(job.job_id, prefix_ids, question_ids, fusion, gen, kv_tokens=kv_tokens,
                         prefill_tokens=prefill_tokens, n=n)
        self.job = job
        self.kept = kept
        self.dropped = dropped
        self.context_tokens = context_tokens
        self.full_prefill = full_prefill
        self.kv = kv
        self.rebuilt = 0
        self.kv_reads: dict[str, int] = {}  # chunks served per store tier (ChunkCache.last_reads)
        self.computed: dict[str, float] = {}  # chunks computed here and read, seconds (ChunkCache.last_computed)
        self.shadow_steps: list[Any] | None = None  # the answer's logits, kept for a shadow check (shadow.py)
        self.ended: dict[int, Sequence] = {}  # n > 1: the rows that finished, by choice index
        # chunks in no tier this query did not compute: it is answered by a full prefill instead
        # (reload_policy.full_prefill_first), and the worker computes them afterwards (WorkerCore.defer)
        self.deferred: list[P.ChunkRef] = []
        self.cold_full_prefill = False

    def plan_message(self, step: int) -> P.Plan:
        served = self.fusion.method if self.cold_full_prefill else None  # not the request's: say which ran
        return P.Plan(self.job.job_id, self.kept, self.dropped, self.context_tokens, len(self.prefix_ids),
                      len(self.question_ids), step, method=served)

    def load_kv(self) -> tuple[Any, list[Any]]:
        """The chunks' KV from the store (rebuilt from their tokens on a miss), the system prompt's cached."""
        from kvfuse.fusion import ChunkKV
        from kvfuse.fusion.methods import get_method

        chunks, kv = [self.job.chunks[i] for i in self.kept], self.kv
        if self.full_prefill:  # prefills from the tokens: no stored KV to read
            return ChunkKV(self.prefix_ids), [ChunkKV(c.token_ids) for c in chunks]
        wanted = [(c.key, c.token_ids, c.context) for c in chunks]
        if get_method(self.fusion.method).own_pipeline:  # samkv reads only the blocks it selects
            loaded = kv.block_sources(wanted)
        else:  # every chunk's blob read at once, on the store's read threads; those in no tier computed
            loaded = [ckv for ckv, _ in kv.load_all(wanted)]
        self.kv_reads, self.computed = dict(kv.last_reads), dict(kv.last_computed)
        self.rebuilt = int(self.computed["chunks_computed"])  # its last load's (a load redone after a wait counts once)
        return kv.prefixes.get(self.prefix_ids), loaded

    def finished_row(self, row: Sequence) -> bool:
        """A row of this query finished (itself or a fork): True once all n have, the Result due."""
        self.ended[row.index] = row
        return len(self.ended) == self.n

    def result(self, step: int) -> P.Result:
        timings = {k: float(v) for k, v in self.timings.items()}
        timings["decode_s"] = max([self.decode_s, *(r.decode_s for r in self.ended.values())])
        timings["kv_compute_s"] = float(self.computed.get("compute_s", 0.0))
        r = self.generation.result(self.stats, timings)
        logprobs = r.logprobs if self.gen_options.logprobs is not None else None
        usage = dict(r.usage)
        choices = []
        for i in range(1, self.n):  # the forked rows' answers (engine/sequence.py, Sequence.fork)
            c = self.ended[i].generation.result(self.stats, timings)
            choices.append({"index": i, "text": c.text, "finish_reason": c.finish_reason,
                            "logprobs": c.logprobs if logprobs is not None else None,
                            "generated_tokens": c.usage["generated_tokens"]})
            usage["generated_tokens"] += c.usage["generated_tokens"]  # OpenAI's usage: summed over choices
        if self.computed:  # the chunks whose KV was computed for this query (in no tier, or a slow one) and read
            usage["chunks_computed"] = int(self.computed["chunks_computed"])
            usage["chunks_read"] = int(self.computed["chunks_read"])
            usage["computed_chunk_tokens"] = int(self.computed["computed_tokens"])
        if self.cold_full_prefill:  # in no tier, computed after this answer (its full prefill read none of them)
            usage["chunks_deferred"] = len(self.deferred)
            self.kv_reads[f"source:{policy.RECOMPUTE}:{policy.DEFERRED}"] = len(self.deferred)
        # deferred chunks are rebuilt for this query too, after its answer (kvfuse_rebuilt_chunks_total)
        rebuilt = self.rebuilt + len(self.deferred)
        return P.Result(self.job.job_id, r.text, r.finish_reason, usage, r.timings, rebuilt, step,
                        logprobs=logprobs, kv_reads=self.kv_reads, choices=choices)


def fitting(costs: Iterable[int], budget_tokens: int) -> int:
    """How many of the leading items an ingestion piece takes: while their costs (a chunk's tokens and its
    context's) stay within the budget, and at least one."""
    taken = tokens = 0
    for cost in costs:
        if taken and tokens + cost > budget_tokens:
            break
        taken += 1
        tokens += cost
    return taken


class _Slices:
    """The piece in flight of an ingestion job, its forwards run `layers` decoder layers per ingestion
    turn (0: the whole piece in one turn): a query arriving meanwhile waits for one slice, not the piece
    (the engine core keeps the piece's memory while it is IN_FLIGHT; docs/DESIGN.md, "Bounded under load")."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.flight: Generator[None, None, Any] | None = None

    def turn(self, start: Callable[[], Generator[None, None, Any]]) -> tuple[bool, Any]:
        """One turn: the piece in flight resumed, or `start()`'s begun; (True, its value) once it ended."""
        if self.flight is None:
            self.flight = start()
        done, value = advance(self.flight, self.layers)
        if done:
            self.flight = None
        return done, value

    def stop(self) -> None:
        """The job was cancelled: its forward in flight abandoned (layer_pause.py)."""
        if self.flight is not None:
            self.flight.close()
            self.flight = None


class IngestTask:
    """A precompute job, run a piece (up to a token budget, at least one chunk) at a time, each piece
    `layers` decoder layers per ingestion step (`_Slices`)."""

    def __init__(self, job: P.PrecomputeJob, layers: int = 0) -> None:
        self.job = job
        self.keys: list[str] | None = None
        self.nbytes: list[int] = []
        self.todo: list[int] = []  # chunk indices still to compute
        self.computed = 0
        self.slices = _Slices(layers)

    def _plan(self, kv: ChunkCache) -> None:
        """The chunks' keys, and which of them are still to compute (once, before the first piece)."""
        if self.keys is not None:
            return
        chunks = self.job.chunks
        self.keys = [kv.key_of(ids, self.job.context(i)) for i, ids in enumerate(chunks)]
        for i, (key, ids) in enumerate(zip(self.keys, chunks, strict=True)):
            if kv.store.has_or_fetch(key):
                # Content-addressed: an identical chunk (same model, dtype, tokens, context) is stored once
                # (taken from the object store when only that holds it).
                self.nbytes.append(kv.stored_nbytes(len(ids)))
            else:
                self.nbytes.append(-1)
                self.todo.append(i)

    def _piece(self, budget_tokens: int) -> list[int]:
        """The chunks of the next piece: up to the budget of tokens (contexts counted), at least one."""
        costs = (len(self.job.chunks[i]) + len(self.job.context(i)) for i in self.todo)  # a context is prefilled too
        return self.todo[:fitting(costs, budget_tokens)]

    def need(self, kv: ChunkCache, budget_tokens: int) -> int:
        """The KV tokens the next piece holds at most on the model's device while it runs (ChunkCache.
        compute_peak, as a query's load counts its cold chunks): its largest forward's cache beside the
        piece's chunks computed. The engine core reserves it."""
        self._plan(kv)
        piece = self._piece(budget_tokens)
        return kv.compute_peak([self.job.chunks[i] for i in piece], [self.job.context(i) for i in piece])

    def run_piece(self, kv: ChunkCache, budget_tokens: int) -> P.Done | InFlight | None:
        """Run one slice of the piece in flight, or start the next; IN_FLIGHT while it is paused between
        layers, then None, or the job's Done once every chunk is stored."""
        self._plan(kv)
        done, _ = self.slices.turn(lambda: self._store_piece(kv, budget_tokens))
        if not done:
            return IN_FLIGHT
        if self.todo:
            return None
        assert self.keys is not None
        return P.Done(self.job.job_id, list(self.keys), list(self.nbytes), self.computed)

    def stop(self) -> None:
        """The job was cancelled: its piece in flight abandoned (`_Slices.stop`)."""
        self.slices.stop()

    def _store_piece(self, kv: ChunkCache, budget_tokens: int) -> Generator[None, None, None]:
        """The next piece computed (its forwards paused between layers) and stored."""
        assert self.keys is not None
        chunks = self.job.chunks
        piece = self._piece(budget_tokens)
        self.todo = self.todo[len(piece):]
        if piece:
            stored = dict((yield from kv.compute_and_store_steps(
                [chunks[i] for i in piece], [self.job.context(i) for i in piece],
                referenced_only=self.job.referenced_only)))
            for i in piece:
                self.nbytes[i] = stored.get(self.keys[i], 0)
            self.computed += len(piece)


class DeferredChunks:
    """The cold chunks of a query answered by a full prefill (plan_query), computed after it as an
    ingestion job: a piece of up to the step's token budget (a chunk's tokens and its context's) at a time,
    `layers` decoder layers per ingestion step (`_Slices`), each computed after its recorded context and
    kept (ChunkCache.compute_and_keep). Their keys sit in `holding` (the worker's, shared by every such
    job) until computed, so a query that meets them meanwhile defers none of them again."""

    def __init__(self, chunks: list[P.ChunkRef], holding: set[str], layers: int = 0) -> None:
        self.todo = list(chunks)
        self.total = len(chunks)
        self.holding = holding
        holding.update(c.key for c in chunks)
        self.slices = _Slices(layers)
        self.piece: list[P.ChunkRef] = []  # the piece in flight

    def _piece(self, budget_tokens: int) -> list[P.ChunkRef]:
        return self.todo[:fitting(map(_cost, self.todo), budget_tokens)]

    def need(self, kv: ChunkCache, budget_tokens: int) -> int:
        """The KV tokens the next piece holds at most while it runs (ChunkCache.compute_peak)."""
        known = [c for c in self._piece(budget_tokens) if c.context is not None]  # the others are not computed
        return kv.compute_peak([c.token_ids for c in known], [c.context or [] for c in known])

    def run_piece(self, kv: ChunkCache, budget_tokens: int) -> int | InFlight | None:
        """Run one slice of the piece in flight, or start the next; IN_FLIGHT while it is paused between
        layers, then None, or the chunk count once every chunk is done."""
        def start() -> Generator[None, None, int]:
            self.piece = self._piece(budget_tokens)
            self.todo = self.todo[len(self.piece):]
            return kv.compute_and_keep_steps([(c.key, c.token_ids, c.context) for c in self.piece])

        try:
            done, _ = self.slices.turn(start)
        except BaseException:
            self.stop()  # the job ends here: none held
            raise
        if not done:
            return IN_FLIGHT
        self.holding.difference_update(c.key for c in self.piece)
        self.piece = []
        return None if self.todo else self.total

    def stop(self) -> None:
        """The job ends unfinished (failed or cancelled): its forward in flight abandoned, no key held."""
        self.slices.stop()
        self.holding.difference_update(c.key for c in [*self.piece, *self.todo])
        self.piece, self.todo = [], []


def _cost(c: P.ChunkRef) -> int:
    """A chunk's tokens to compute: its own and its recorded context's."""
    return len(c.token_ids) + len(c.context or ())
