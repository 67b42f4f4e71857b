"""The query pipeline shared by /v1/query and /v1/chat/completions.

prepare(): validate knobs, check the prompt can fit the context (prompt_size.py, before any embedding),
retrieve (dense, keyword or hybrid: retrieval.py) or take the caller's documents in order, and
gather each chunk's store key and token ids (sources.py; split from the document's tokens by the stored chunk sizes,
so chunking settings may change later without invalidating stored KV). start(): queue the job and wait
for the worker's plan (which chunks fit the context), so errors still get a proper HTTP status. Then
`events()` streams the deltas and the final result.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvfuse.service.dispatch.job_book import (
    Job,
    NoLiveWorker,
    QueueFull,
    WorkerCrashed,
    WorkerFailed,
    WorkerJobError,
    WorkerUnavailable,
)
from kvfuse.service.errors import APIError, model_failed, retry_after
from kvfuse.service.rag.conversation import Conversation, fit_history
from kvfuse.service.rag.prompt_size import check_prompt_fits, context_limit
from kvfuse.service.rag.retrieval import RetrievalOptions, check_question, retrieval_options
from kvfuse.service.rag.sources import SourceChunk, Sources
from kvfuse.service.wire.protocol import (
    ERR_CHOICES,
    ERR_CONTEXT_OVERFLOW,
    ERR_INDEX_UNAVAILABLE,
    ERR_INVALID,
    ERR_KV_BUDGET,
    ERR_MAX_TOKENS,
    ChunkRef,
    Delta,
    Plan,
    QueryJob,
    Result,
    prompt_tokens,
)

if TYPE_CHECKING:
    from kvfuse.config import Settings
    from kvfuse.service.metrics import Metrics
    from kvfuse.service.rag.corpus import Corpus
    from kvfuse.service.rag.fidelity import FidelityLedger
    from kvfuse.service.rag.ingest import IngestManager
    from kvfuse.service.rag.query_log import QueryLog

Gone = Callable[[], Awaitable[bool]]  # whether the client has gone (a request's is_disconnected)


_DISCONNECT_POLL_S = 0.25
_MAX_STOP = 4  # stop strings per request, OpenAI's limit


class ClientGone(Exception):
    """The client disconnected before its answer was complete."""


async def next_unless_gone(agen: AsyncIterator[Any], gone: Gone | None) -> Any:
    """The next item of `agen`, watching for a client that leaves meanwhile (a query waiting in the queue,
    or a long generation nobody reads any more): then the pending read is cancelled and ClientGone raised."""
    nxt = asyncio.ensure_future(anext(agen))
    while True:
        done, _ = await asyncio.wait({nxt}, timeout=_DISCONNECT_POLL_S)
        if done:
            return nxt.result()
        if gone is not None and await gone():
            nxt.cancel()  # the worker job is cancelled by the caller or by the generator's cleanup
            await asyncio.gather(nxt, return_exceptions=True)
            raise ClientGone()


@dataclass
class QueryPlan:
    question: str
    system_prompt: str | None
    chunks: list[SourceChunk]
    explicit: bool
    retrieval: RetrievalOptions
    fusion: dict[str, Any]
    generation: dict[str, Any]
    retrieval_s: float
    arrived: float
    deadline: float
    conversation: Conversation | None = None  # a chat's earlier turns kept for the prompt (rag/conversation.py)
    ratio_source: str = "request"  # request | config | auto (held for the target, rag/fidelity.py)
    size_bucket: str | None = None  # the prompt-size bucket an "auto" ratio was held for
    prompt_order: str = "best-first"  # where the retrieved chunks went (model.prompt_order)
    filters: dict | None = None  # the request's metadata filters (retrieved chunks only)
    top_k: int = 0  # chunks retrieved (named documents: unused)
    n: int = 1  # choices decoded from the one fused prefill (the OpenAI endpoints' n)


@dataclass
class QueryRun:
    """A submitted query: its plan, its job on the API side of the seam (`job.status` says where it
    stands) and the events its answer arrives as."""

    plan: QueryPlan
    job: Job
    events: AsyncIterator[tuple[str, dict]]
    sources: list[SourceChunk]
    dropped: list[SourceChunk]
    logprobs: list | None = None  # every generated token's (fusion/engine/logprobs.py), once the Result came, if asked
    choices: list[dict] = dataclasses.field(default_factory=list)  # n > 1: choices 1..n-1 (wire Result.choices)
    method: str | None = None  # the method the worker ran when not the plan's (wire Plan.method: cold chunks)

    @property
    def warning(self) -> str | None:
        notes = [w for w in (self._dropped_warning, self.plan.conversation and self.plan.conversation.warning) if w]
        return " ".join(notes) or None

    @property
    def _dropped_warning(self) -> str | None:
        if not self.dropped:
            return None
        return (f"{len(self.dropped)} retrieved chunk(s) did not fit the model context beside the question and "
                "max_tokens and were left out (lowest score first)")


@dataclass
class QueryOutcome:
    """A finished run: the worker's result (`Result` as a dict), when its first token and its end arrived,
    and the prompt tokens whose stored KV went into the answer unchanged."""

    result: dict
    first_at: float | None
    ended_at: float
    cached_tokens: int


def cached_tokens(plan: QueryPlan, usage: dict, served: str | None = None) -> int:
    """Reused = prompt tokens whose stored KV went into the answer unchanged (vanilla reuses nothing, nor
    does a query the worker answered by a full prefill, `served`): not those the fusion recomputed, nor the
    chunks computed for this query (in no tier: first use)."""
    if (served or plan.fusion["method"]) == "vanilla":
        return 0
    return max(0, usage.get("prefix_tokens", 0) + usage.get("context_tokens", 0) - usage.get("recomputed_tokens", 0)
               - usage.get("computed_chunk_tokens", 0))


class QueryService:
    """Queries from the request's knobs to the worker's last message, over the corpus (attached once
    loaded) and the dispatcher; a stale document found on the way is handed to ingestion to rebuild."""

    def __init__(self, settings: Settings, metrics: Metrics, dispatcher: Any, ingest: IngestManager,
                 fidelity: FidelityLedger | None = None, query_log: QueryLog | None = None) -> None:
        self.settings = settings
        self.fidelity = fidelity
        self.query_log = query_log  # answered queries, when `fidelity.query_log` is on (rag/query_log.py)
        self.metrics = metrics
        self.dispatcher = dispatcher
        self.ingest = ingest
        self.corpus: Corpus | None = None
        self.sources: Sources | None = None

    def attach(self, corpus: Corpus) -> None:
        self.corpus = corpus
        self.sources = Sources(self.settings, self.metrics, self.dispatcher, self.ingest, corpus)

    # -- preparation ---------------------------------------------------------------------------------------
    async def prepare(self, *, question: str, system_prompt: str | None, top_k: int | None,
                      document_ids: list[str] | None, filters: dict | None, retrieval: Any | None,
                      fusion: Any | None, gen: Any, arrived: float,
                      turns: list[tuple[str, str]] | None = None,
                      visible: frozenset[str] | None = None, retrieve: bool = True) -> QueryPlan:
        """`fusion` and `gen` are the request's knobs (pydantic models: api/schemas.py FusionIn and
        GenerationIn); unset ones take the configured defaults. `turns`: a chat's earlier messages, (role,
        text) oldest first (rag/conversation.py). `visible`: the collections the caller's key sees (None =
        every one); others answer as absent. `retrieve` False: no documents at all (a prompt that holds
        its own context, /v1/completions' `use_retrieval: false`), retrieval mode "none". The corpus must
        be loaded."""
        s = self.settings
        check_question(s, question, top_k)
        requested_ratio = fusion.recompute_ratio if fusion is not None else None
        fusion_opts = self.fusion_options(fusion)
        gen_opts = self.generation_options(gen)
        system_prompt = system_prompt if system_prompt is not None else s.model.system_prompt
        conversation = None
        if turns:
            conversation = await asyncio.to_thread(fit_history, self.corpus.chunker, turns, question,
                                                   s.generation.history_max_tokens)
        history = conversation.history if conversation else []
        await check_prompt_fits(self.corpus.chunker, context_limit(self.dispatcher.info, s), question,
                                system_prompt, gen_opts["max_tokens"], history)  # before the embedding
        search_for = conversation.retrieval_query if conversation else question
        retrieval_opts = retrieval_options(s, retrieval, visible)
        top_k = top_k or s.retriever.top_k
        t0 = time.perf_counter()
        if not retrieve:
            chunks, retrieval_opts = [], dataclasses.replace(retrieval_opts, mode="none")
        elif document_ids is not None:
            chunks = await asyncio.to_thread(self.sources.named, document_ids, visible)
        else:
            chunks = await asyncio.to_thread(self.sources.searched, search_for, top_k, retrieval_opts, filters)
        retrieval_s = time.perf_counter() - t0
        if document_ids is None and retrieve:
            self.metrics.retrieval.observe(retrieval_s)
        source, bucket = "request" if requested_ratio is not None else "config", None
        if self.fidelity is not None and self.fidelity.auto(requested_ratio):
            bucket = self.fidelity.resolve(fusion_opts, sum(len(c.token_ids) for c in chunks))
            source = "auto" if bucket is not None else "config"
        return QueryPlan(question=question, system_prompt=system_prompt, chunks=chunks,
                         explicit=retrieve and document_ids is not None, retrieval=retrieval_opts, fusion=fusion_opts,
                         generation=gen_opts, retrieval_s=retrieval_s, arrived=arrived,
                         deadline=arrived + s.server.request_timeout_s, conversation=conversation,
                         ratio_source=source, size_bucket=bucket, prompt_order=s.model.prompt_order,
                         filters=filters, top_k=top_k)

    def fusion_options(self, fusion: Any | None) -> dict[str, Any]:
        from kvfuse.fusion import available_methods
        from kvfuse.fusion.types import request_knobs

        opts = request_knobs(self.settings.fusion)  # config.fusion also holds engine-wide settings
        if fusion is not None:
            opts.update(fusion.model_dump(exclude_none=True))
        if opts["recompute_ratio"] == "auto":  # resolved once the prompt's size is known (prepare)
            opts["recompute_ratio"] = self.settings.fusion.recompute_ratio
        methods = available_methods()
        if opts["method"] not in methods:
            raise APIError(422, f"unknown fusion method {opts['method']!r}; available: {', '.join(methods)}",
                           code="unknown_fusion_method", param="fusion.method")
        layers = self.dispatcher.info.get("num_layers")
        if layers is not None and opts["check_layer"] >= layers:
            raise APIError(422, f"fusion.check_layer must be below the model's {layers} layers",
                           code="invalid_value", param="fusion.check_layer")
        return opts

    def generation_options(self, gen: Any) -> dict[str, Any]:
        g = self.settings.generation
        max_tokens = gen.max_tokens if gen.max_tokens is not None else g.max_tokens
        if max_tokens > g.max_tokens_limit:
            raise APIError(422, f"max_tokens {max_tokens} exceeds the limit of {g.max_tokens_limit}",
                           code="invalid_value", param="max_tokens")
        stop = [gen.stop] if isinstance(gen.stop, str) else list(gen.stop or [])
        if len(stop) > _MAX_STOP:
            raise APIError(422, f"stop has {len(stop)} strings; at most {_MAX_STOP} are allowed (as in OpenAI's API)",
                           code="invalid_value", param="stop")
        if any(not s for s in stop):
            raise APIError(422, "stop strings must not be empty", code="invalid_value", param="stop")
        # OpenAI's logprobs / top_logprobs (chat only): None = none, n = the chosen token's and n more
        logprobs = (getattr(gen, "top_logprobs", None) or 0) if getattr(gen, "logprobs", False) else None
        # OpenAI's logit_bias and penalties (the OpenAI endpoints only; engine/sampling.py applies them)
        adjust = {k: v for k in ("presence_penalty", "frequency_penalty") if (v := getattr(gen, k, None))}
        if bias := {int(t): b for t, b in (getattr(gen, "logit_bias", None) or {}).items() if b}:
            adjust["logit_bias"] = bias
        if grammar := getattr(gen, "response_grammar", None):  # response_format (engine/grammar.py)
            adjust["grammar"] = grammar
        return {"max_tokens": max_tokens, "temperature": g.temperature if gen.temperature is None else gen.temperature,
                "top_p": g.top_p if gen.top_p is None else gen.top_p, "seed": gen.seed, "stop": stop,
                "logprobs": logprobs, **adjust}


    # -- running -------------------------------------------------------------------------------------------
    async def start(self, plan: QueryPlan, gone: Gone | None) -> QueryRun:
        """Queue the job and wait for the worker's plan (which chunks fit), watching `gone` meanwhile."""
        message = QueryJob(question=plan.question, system_prompt=plan.system_prompt, explicit=plan.explicit,
                           fusion=plan.fusion, generation=plan.generation,
                           chunks=[ChunkRef(c.key, c.token_ids, c.score, c.name, c.context) for c in plan.chunks],
                           history=[list(t) for t in plan.conversation.history] if plan.conversation else [],
                           n=plan.n)
        try:
            job = self.dispatcher.submit(message)
        except QueueFull as err:
            self.metrics.requests.labels("rejected").inc()
            raise APIError(429, f"the query queue is full ({err}); retry later", code="queue_full",
                           headers={"Retry-After": str(self.settings.server.retry_after_s)}) from None
        except WorkerUnavailable as err:
            raise APIError(503, str(err), code="shutting_down") from None
        except WorkerCrashed as err:  # NoLiveWorker, WorkerFailed: refused before it ran
            raise self.api_error(err) from None
        events = self.dispatcher.events(job, plan.deadline)
        try:
            first = await next_unless_gone(events, gone)
        except BaseException as err:
            self.dispatcher.cancel(job)
            raise self.api_error(err) from None
        if not isinstance(first, Plan):
            self.dispatcher.cancel(job)
            raise APIError(500, f"unexpected worker message {type(first).__name__}", code="internal_error")
        kept = [plan.chunks[i] for i in first.kept]
        dropped = [plan.chunks[i] for i in first.dropped]
        return QueryRun(plan=plan, job=job, events=events, sources=kept, dropped=dropped, method=first.method)

    def api_error(self, err: BaseException) -> BaseException:
        """The HTTP error for a failure of a running query (other exceptions pass through)."""
        if isinstance(err, WorkerJobError):
            self.metrics.requests.labels("refused").inc()
            if err.kind == ERR_CHOICES:
                return APIError(400, err.message, code=err.kind, param="n")
            if err.kind in (ERR_CONTEXT_OVERFLOW, ERR_MAX_TOKENS, ERR_KV_BUDGET):
                return APIError(400, err.message, code=err.kind,
                                param="document_ids" if err.kind == ERR_CONTEXT_OVERFLOW else "max_tokens")
            if err.kind == ERR_INVALID:
                return APIError(422, err.message, code="invalid_value")
            if err.kind == ERR_INDEX_UNAVAILABLE:
                return APIError(503, f"the document index is unavailable: {err.message}", code="index_unavailable",
                                headers=retry_after(self.settings))
            return APIError(500, f"generation failed: {err.message}", code="generation_failed")
        if isinstance(err, NoLiveWorker):
            self.metrics.requests.labels("no_live_worker").inc()
            return APIError(503, f"{err}; retry once a worker has joined (GET /ready lists the live workers)",
                            code="no_live_worker", headers=retry_after(self.settings))
        if isinstance(err, WorkerFailed):
            self.metrics.requests.labels("worker_crashed").inc()
            return model_failed(str(err))
        if isinstance(err, WorkerCrashed):
            self.metrics.requests.labels("worker_crashed").inc()
            return APIError(503, f"{err}; {self.dispatcher.crash_advice}", code="worker_crashed", headers=retry_after(self.settings))
        if isinstance(err, TimeoutError):
            self.metrics.requests.labels("timeout").inc()
            return APIError(504, f"the query did not finish within {self.settings.server.request_timeout_s} s",
                            code="timeout")
        if isinstance(err, ClientGone | asyncio.CancelledError):
            self.metrics.requests.labels("cancelled").inc()
        return err

    async def stream(self, run: QueryRun) -> AsyncIterator[tuple[str, Any]]:
        """("delta", {"text", "logprobs", "index"}) messages (index: the choice, n > 1), then ("result", QueryOutcome). Raises the mapped APIError on failure;
        cancels the job if the consumer stops early (client gone, timeout)."""
        m = self.metrics
        first_at: float | None = None
        last_at = None
        finished = False
        try:
            async for msg in run.events:
                now = time.monotonic()
                if isinstance(msg, Delta):
                    if first_at is None:
                        first_at = now
                        m.ttft.observe(now - run.plan.arrived)
                    else:
                        m.itl.observe(now - last_at)
                    last_at = now
                    yield "delta", {"text": msg.text, "logprobs": msg.logprobs, "index": msg.index}
                elif isinstance(msg, Result):
                    finished = True
                    run.logprobs, run.choices = msg.logprobs, msg.choices
                    p = dataclasses.asdict(msg)
                    u = p["usage"]
                    outcome = QueryOutcome(p, first_at, now, cached_tokens(run.plan, u, run.method))
                    m.e2e.observe(now - run.plan.arrived)
                    m.kv_load.observe(p["timings"].get("kv_load_s", 0.0))
                    m.hit_tokens.inc(outcome.cached_tokens)
                    m.query_tokens.inc(prompt_tokens(u))
                    m.rebuilt_chunks.inc(p.get("rebuilt_chunks", 0))
                    for tier, n in p.get("kv_reads", {}).items():
                        if tier == "device_bytes":
                            m.kv_device_tier_bytes.set(n)
                        elif tier.startswith("source:"):  # source:<read|recompute>:<reason>
                            m.kv_chunk_sources.labels(*tier.split(":")[1:3]).inc(n)
                        elif tier.startswith("bytes:"):  # bytes:<tier>, what it holds now
                            m.kv_tier_bytes.labels(tier[6:]).set(n)
                        elif tier.startswith("evictions:"):  # evictions:<tier>, a running total
                            m.tier_evictions(p.get("worker", ""), tier[10:], n)
                        elif n:
                            m.kv_tier_reads.labels(tier).inc(n)
                    m.requests.labels(p["finish_reason"] if p["finish_reason"] == "cancelled" else "ok").inc()
                    if self.query_log is not None and p["finish_reason"] != "cancelled":
                        self.query_log.record(run)  # handed to its writer thread: the answer does not wait
                    yield "result", outcome
                else:  # Cancelled: ended before the worker started it
                    finished = True
                    return
        except BaseException as err:
            raise self.api_error(err) from None
        finally:
            if not finished:
                self.dispatcher.cancel(run.job)
