"""The answer a client reads, built from a query's run: its sources (the stream's first event and part of
every answer), and the final answer with its token counts and timings measured from the request's
arrival. The query pipeline (rag/query.py) returns plain data; only this module knows the response models.
"""

from __future__ import annotations

from kvfuse.service.api.responses import (
    ChunkOut,
    FusionUsed,
    QueryAnswer,
    QuerySources,
    RetrievalUsed,
    SearchResults,
    Source,
    Timings,
    Usage,
)
from kvfuse.service.rag.chunks import FoundChunk
from kvfuse.service.rag.query import QueryOutcome, QueryRun
from kvfuse.service.rag.retrieval import RetrievalOptions
from kvfuse.service.rag.sources import SourceChunk
from kvfuse.service.wire.protocol import prompt_tokens


def source(c: SourceChunk | FoundChunk, label: int | None = None) -> Source:
    """A chunk as a citation: where it is, its text and its document's metadata, how it was found, and its
    number in the prompt (`label`, the [n] the labelled prompt gives it)."""
    tokens = c.tokens if isinstance(c, FoundChunk) else len(c.token_ids)
    return Source(document_id=c.document_id, chunk_index=c.chunk_index, score=round(c.score, 6), tokens=tokens,
                  dense_rank=c.dense_rank, keyword_rank=c.keyword_rank, text=c.text, metadata=c.metadata,
                  page=c.location.get("page"), section=c.location.get("section"), label=label)


def chunk_out(c: FoundChunk) -> ChunkOut:
    return ChunkOut(chunk_index=c.chunk_index, text=c.text, tokens=c.tokens, page=c.location.get("page"),
                    section=c.location.get("section"))


def search_results(found: list[FoundChunk], opts: RetrievalOptions, elapsed_s: float) -> SearchResults:
    return SearchResults(results=[source(c) for c in found],
                         retrieval=RetrievalUsed(mode=opts.mode, collections=opts.searched),
                         retrieval_ms=round(1000.0 * elapsed_s, 2))


def sources_of(run: QueryRun) -> QuerySources:
    """What the answer is built on."""
    plan = run.plan
    fusion = FusionUsed(method=run.method or plan.fusion["method"], recompute_ratio=plan.fusion["recompute_ratio"],
                        ratio_source=plan.ratio_source, size_bucket=plan.size_bucket,
                        requested_method=plan.fusion["method"] if run.method else None)
    retrieval = RetrievalUsed(mode="explicit" if plan.explicit else plan.retrieval.mode,
                              collections=plan.retrieval.searched)
    # a kept source's number is its place in the prompt (the [n] the labelled prompt gives it); retrieved
    # sources are listed best first whatever that place (model.prompt_order), named ones as named
    numbered = list(enumerate(run.sources, start=1))
    if not plan.explicit and plan.prompt_order == "best-last":
        numbered.reverse()
    return QuerySources(sources=[source(c, n) for n, c in numbered],
                        dropped_sources=[source(c) for c in run.dropped],
                        warning=run.warning, fusion=fusion, retrieval=retrieval)


def answer_of(run: QueryRun, outcome: QueryOutcome) -> QueryAnswer:
    """The answer from the worker's result: its token counts as the client reads them, and timings."""
    result, end = outcome.result, outcome.ended_at
    u, t = result["usage"], result["timings"]
    ms = lambda s: round(1000.0 * s, 2)  # noqa: E731
    job, arrived = run.job, run.plan.arrived
    return QueryAnswer(
        **dict(sources_of(run)),
        answer=result["text"],
        finish_reason=result["finish_reason"],
        usage=Usage(prompt_tokens=prompt_tokens(u), completion_tokens=u.get("generated_tokens", 0),
                    context_tokens=u.get("context_tokens", 0), cached_tokens=outcome.cached_tokens,
                    recomputed_tokens=u.get("recomputed_tokens", 0), chunks_read=u.get("chunks_read"),
                    chunks_computed=u.get("chunks_computed"), chunks_deferred=u.get("chunks_deferred")),
        timings=Timings(retrieval_ms=ms(run.plan.retrieval_s), queue_ms=ms((job.started_at or end) - job.enqueued_at),
                        kv_load_ms=ms(t.get("kv_load_s", 0.0)), assemble_ms=ms(t.get("assemble_s", 0.0)),
                        select_ms=ms(t.get("select_s", 0.0)), recompute_ms=ms(t.get("recompute_s", 0.0)),
                        kv_compute_ms=ms(t.get("kv_compute_s", 0.0)),
                        ttft_ms=ms((outcome.first_at or end) - arrived), decode_ms=ms(t.get("decode_s", 0.0)),
                        total_ms=ms(end - arrived)),
        worker=result.get("worker") or None,
    )
