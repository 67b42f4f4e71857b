"""Warm-up endpoints: POST /v1/documents/{id}/precompute and POST /v1/collections/{name}/precompute compute
the chunk KV of documents ingested with `precompute_at: first_use` ahead of their first query
(kvfuse/service/rag/warmup.py). They answer once it is stored."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from kvfuse.service.api.dependencies import Caller, ReadyState
from kvfuse.service.api.errors import ERROR_RESPONSES
from kvfuse.service.api.responses import Precomputed
from kvfuse.service.errors import APIError, collection_not_found, document_not_found
from kvfuse.service.rag.warmup import precompute_document

router = APIRouter(responses=ERROR_RESPONSES)


async def _warm(state: ReadyState, records: list) -> Precomputed:
    out = Precomputed(documents=[], chunks=0, computed=0, kv_chunks=0)
    for rec in records:
        got = await precompute_document(state.corpus, state.ingest.dispatcher, state.settings, state.metrics, rec)
        out.documents.append(rec.id)
        out.chunks += got["chunks"]
        out.computed += got["computed"]
        out.kv_chunks += got["kv_chunks"]
    return out


@router.post("/v1/documents/{doc_id}/precompute")
async def precompute_one(state: ReadyState, caller: Caller, doc_id: str) -> Precomputed:
    """Compute the KV of the document's chunks that no tier holds; 409 while it is not ready."""
    caller.check_write()
    rec = await asyncio.to_thread(state.corpus.store.get_document, doc_id)
    if rec is None:
        raise document_not_found(doc_id)
    caller.check_document(doc_id, rec.collection)
    if rec.status != "ready":
        raise APIError(409, f"document {doc_id!r} is {rec.status}, not ready", code="document_not_ready")
    return await _warm(state, [rec])


@router.post("/v1/collections/{collection}/precompute")
async def precompute_collection(state: ReadyState, caller: Caller, collection: str) -> Precomputed:
    """Compute the KV of every ready document of the collection whose chunks no tier holds."""
    caller.check_write()
    caller.check_collection(collection)
    records: list = []
    while True:
        page, _ = await asyncio.to_thread(state.corpus.store.list_documents, offset=len(records), limit=500,
                                          collection=collection)
        if not page:
            break
        records.extend(page)
    ready = [r for r in records if r.status == "ready"]
    if not ready:
        raise collection_not_found(collection)
    return await _warm(state, ready)
