"""Retrieval without generation: POST /v1/search (the chunks a query would be answered from, with their
text, scores, ranks and metadata) and GET /v1/documents/{id}/chunks (a document's chunks, for citations).

Both are answered by the API process alone: no model, no worker, so they work with `--workers 0` while
the fleet's workers are busy or absent. Collections are picked in one place each (`retrieval.collections`
through `retrieval_options`; the document's own collection here), where a key's allowed collections apply.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from kvfuse.service.api.answers import chunk_out, search_results
from kvfuse.service.api.dependencies import Caller, ReadyState
from kvfuse.service.api.errors import ERROR_RESPONSES
from kvfuse.service.api.responses import ChunkList, SearchResults
from kvfuse.service.api.schemas import SearchIn, documented_body, parse_json, validate
from kvfuse.service.errors import APIError
from kvfuse.service.rag.chunks import document_chunks, reader_metadata
from kvfuse.service.rag.retrieval import search_chunks

router = APIRouter(responses=ERROR_RESPONSES)


@router.post("/v1/search", response_model=SearchResults, openapi_extra=documented_body(SearchIn))
async def search(request: Request, state: ReadyState, caller: Caller) -> SearchResults:
    """The top_k chunks for `query` under the same retrieval options, filters and collections as
    /v1/query, best first. The body is read by hand, as for /v1/query; its schema is `SearchIn`."""
    body = validate(SearchIn, parse_json(await request.body()))
    found, opts, elapsed = await search_chunks(state.settings, state.metrics, state.corpus, question=body.query,
                                               top_k=body.top_k, filters=body.filters, retrieval=body.retrieval,
                                               visible=caller.allowed_collections)
    return search_results(found, opts, elapsed)


@router.get("/v1/documents/{doc_id}/chunks")
async def list_chunks(state: ReadyState, caller: Caller, doc_id: str) -> ChunkList:
    """A ready document's chunks in order: what a source's `chunk_index` points at."""
    rec = await asyncio.to_thread(state.corpus.store.get_document, doc_id)
    job = state.ingest.unfinished(doc_id)
    owner = job.rec.collection if job is not None else rec.collection if rec is not None else None
    if owner is not None:
        caller.check_document(doc_id, owner)
    if rec is None:
        if job is not None:
            raise APIError(409, f"document {doc_id!r} is being ingested and has no chunks yet",
                           code="document_not_ready")
        raise APIError(404, f"document {doc_id!r} not found", code="document_not_found")
    if rec.status != "ready":
        raise APIError(409, f"document {doc_id!r} is {rec.status}: it has no chunks", code="document_not_ready")
    chunks = await asyncio.to_thread(document_chunks, state.corpus, rec)
    return ChunkList(document_id=rec.id, collection=rec.collection, metadata=reader_metadata(rec.metadata),
                     chunks=[chunk_out(c) for c in chunks])
