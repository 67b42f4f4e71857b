"""The worker's per-job state: a query from arrival to its last token, and an ingestion job in pieces.

Kept apart from the engine loop (core.py) so that the loop reads as the step it is: admit, ingest,
decode, retire. A query is checked on arrival (does it fit the context and the KV budget at all?) and
planned (which retrieved chunks fit), waits in the scheduler, and on admission loads its chunk KV; its
fused prefill then runs a few decoder layers per engine step (within the step's prefill budget) until it
takes its first token; after that each batched decode step hands it one row of logits. An ingestion job is precomputed a piece at a time (up to the step's token budget), so a large
document shares the worker with running queries instead of holding it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvfuse.service.wire import protocol as P
from kvfuse.service.worker.scheduler import Request
from kvfuse.service.worker.shadow import ShadowChecks

if TYPE_CHECKING:
    from kvfuse.service.worker.chunk_kv import ChunkCache
    from kvfuse.service.worker.scheduler import Scheduler


def plan_query(job: P.QueryJob, engine: Any, scheduler: Scheduler, limit: int, step: int) -> Request | P.Error:
    """The scheduler request of a query, or the Error that refuses it (it could never run): `limit` is the
    worker's context in tokens, `step` the engine step it arrived in."""
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
    kv_budget = scheduler.limits.kv_budget_tokens
    if not scheduler.fits_alone(kv_tokens):
        return P.Error(job.job_id, P.ERR_KV_BUDGET,
                       f"the prompt plus max_tokens ({kv_tokens} tokens) exceed the server's KV budget of "
                       f"{kv_budget} tokens (server.kv_budget_tokens): lower max_tokens or use fewer documents",
                       kv_tokens - kv_budget, step)
    # Prefill work: a full prefill runs every prompt token; a fusion method mainly its recomputed rows.
    prompt = len(prefix_ids) + total + len(question_ids)
    prefill = prompt if full_prefill else int(fusion.recompute_ratio * total) + len(question_ids)
    seq = QuerySequence(job, prefix_ids, question_ids, kept, dropped, total, fusion, gen, full_prefill)
    return Request(job.job_id, kv_tokens=kv_tokens, prefill_tokens=prefill, data=seq)


class QuerySequence:
    """One admitted (or waiting) query: its fused cache and its decoding state."""

    def __init__(self, job: P.QueryJob, prefix_ids: list[int], question_ids: list[int], kept: list[int],
                 dropped: list[int], context_tokens: int, fusion: Any, gen: Any, full_prefill: bool) -> None:
        self.job = job
        self.prefix_ids = prefix_ids
        self.question_ids = question_ids
        self.kept = kept
        self.dropped = dropped
        self.context_tokens = context_tokens
        self.fusion = fusion
        self.gen_options = gen
        self.full_prefill = full_prefill
        self.gen: Any = None  # kvfuse.fusion.engine.generation.Generation, from the prefill on
        self.cache: Any = None
        self.stats: dict[str, int] = {}
        self.timings: dict[str, float] = {}
        self.rebuilt = 0
        self.kv_reads: dict[str, int] = {}  # chunks served per store tier (ChunkCache.last_reads)
        self._steps: Any = None  # the fused prefill in progress (FusionEngine.fuse_steps)
        self.shadow_steps: list[Any] | None = None  # the answer's logits, kept for a shadow check (shadow.py)
        self._t_loaded = self._t_first = 0.0

    def plan_message(self, step: int) -> P.Plan:
        return P.Plan(self.job.job_id, self.kept, self.dropped, self.context_tokens, len(self.prefix_ids),
                      len(self.question_ids), step)

    def start(self, engine: Any, kv: ChunkCache) -> None:
        """Load the chunks' KV and set up the fused prefill, which `advance` then runs in pieces."""
        from kvfuse.fusion import ChunkKV
        from kvfuse.fusion.methods import get_method

        chunks = [self.job.chunks[i] for i in self.kept]
        t0 = time.perf_counter()
        if self.full_prefill:  # prefills from the tokens: no stored KV to read
            loaded = [ChunkKV(c.token_ids) for c in chunks]
            prefix = ChunkKV(self.prefix_ids)
        else:
            if get_method(self.fusion.method).own_pipeline:  # samkv reads only the blocks it selects
                loaded = [kv.block_source(c.key, c.token_ids) for c in chunks]
            else:  # every chunk's blob read at once, on the store's read threads
                got = kv.load_all([(c.key, c.token_ids) for c in chunks])
                loaded = [ckv for ckv, _ in got]
                self.rebuilt += sum(was_rebuilt for _, was_rebuilt in got)
                self.kv_reads = dict(kv.last_reads)
            prefix = kv.prefix_kv(self.prefix_ids)
        self._t_loaded = time.perf_counter()
        self.timings = {"kv_load_s": self._t_loaded - t0}
        self._steps = engine.fuse_steps(prefix, loaded, self.question_ids, self.fusion,
                                        max_tokens=self.gen_options.max_tokens)

    def advance(self, engine: Any, budget: int) -> tuple[int, str | None]:
        """Run the prefill for about `budget` rows x layers (at least one layer): (work done, the first
        token's text once the prefill is complete, else None)."""
        from kvfuse.fusion.engine.generation import Generation

        spent = 0
        try:
            while spent < budget:
                spent += next(self._steps)
        except StopIteration as done:
            fused = done.value
        else:
            return spent, None
        self._steps = None
        self.cache, self.stats = fused.cache, fused.stats
        self.gen = Generation(engine.tokenizer, engine.stop_token_ids, self.gen_options, engine.device)
        text = self.accept(fused.logits)
        self._t_first = time.perf_counter()
        # ttft_s counts from the loaded KV to the first token, including steps spent on other sequences.
        self.timings.update(fused.timings, ttft_s=self._t_first - self._t_loaded)
        return spent, text

    def accept(self, logits: Any) -> str:
        """Choose and take the first token from the prefill's logits."""
        ShadowChecks.record(self, logits)
        return self.gen.accept(logits)

    def accept_token(self, token: int, logits: Any) -> str:
        """Take the token the batch chose for this request from its row `logits` [vocab] of the step (kept
        for a shadow check and for per-token log-probabilities)."""
        ShadowChecks.record(self, logits)
        return self.gen.accept_token(token, logits)

    def result(self, step: int) -> P.Result:
        timings = {k: float(v) for k, v in self.timings.items()}
        timings["decode_s"] = time.perf_counter() - self._t_first
        r = self.gen.result(self.stats, timings)
        logprobs = r.logprobs if self.gen_options.logprobs is not None else None
        return P.Result(self.job.job_id, r.text, r.finish_reason, dict(r.usage), r.timings, self.rebuilt, step,
                        logprobs=logprobs, kv_reads=self.kv_reads)


class IngestTask:
    """A precompute job, run a piece (up to a token budget, at least one chunk) per ingestion step."""

    def __init__(self, job: P.PrecomputeJob) -> None:
        self.job = job
        self.keys: list[str] | None = None
        self.nbytes: list[int] = []
        self.todo: list[int] = []  # chunk indices still to compute
        self.computed = 0

    def run_piece(self, kv: ChunkCache, budget_tokens: int) -> P.Done | None:
        """Compute the next piece; the job's Done once every chunk is stored."""
        chunks = self.job.chunks
        if self.keys is None:
            self.keys = [kv.key_of(ids, self.job.context(i)) for i, ids in enumerate(chunks)]
            for i, (key, ids) in enumerate(zip(self.keys, chunks, strict=True)):
                if kv.store.has_chunk(key):
                    # Content-addressed: an identical chunk (same model, dtype, tokens, context) is stored once.
                    self.nbytes.append(kv.stored_nbytes(len(ids)))
                else:
                    self.nbytes.append(-1)
                    self.todo.append(i)
        piece, tokens = [], 0
        cost = lambda i: len(chunks[i]) + len(self.job.context(i))  # noqa: E731 - a context is prefilled too
        while self.todo and (not piece or tokens + cost(self.todo[0]) <= budget_tokens):
            i = self.todo.pop(0)
            piece.append(i)
            tokens += cost(i)
        if piece:
            stored = dict(kv.compute_and_store([chunks[i] for i in piece], [self.job.context(i) for i in piece]))
            for i in piece:
                self.nbytes[i] = stored[self.keys[i]]
            self.computed += len(piece)
        if self.todo:
            return None
        return P.Done(self.job.job_id, list(self.keys), list(self.nbytes), self.computed)
