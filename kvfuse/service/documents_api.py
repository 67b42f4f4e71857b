"""Document and job endpoints: POST/GET /v1/documents, GET/DELETE /v1/documents/{id}, GET /v1/jobs/{id}."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from kvfuse.service.errors import APIError
from kvfuse.service.ingest import IngestJob, default_doc_id
from kvfuse.service.schemas import (
    DocumentBatchIn,
    DocumentIn,
    OnConflict,
    decode_utf8,
    parse_json,
    validate,
)

router = APIRouter()

_DELETE_WAIT_S = 30.0  # how long DELETE waits for a cancelled ingestion to roll back


def _state(request: Request) -> Any:
    return request.app.state.kv


def document_json(rec: Any, job: IngestJob | None = None) -> dict[str, Any]:
    out = {"id": rec.id, "status": rec.status, "metadata": rec.metadata, "chunks": len(rec.chunk_keys),
           "tokens": rec.tokens, "kv_bytes": rec.kv_bytes, "created_at": rec.created_at,
           "updated_at": rec.updated_at, "error": rec.error, "content_hash": rec.content_hash}
    if job is not None:
        out["job"] = job.to_json()
    return out


def _parse_documents(request: Request, raw: bytes, doc_id: str | None, on_conflict: str | None
                     ) -> tuple[list[DocumentIn], bool, str]:
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if ctype == "text/plain":
        # A raw upload: the body is the text; id and on_conflict come from the query string.
        doc = validate(DocumentIn, {"id": doc_id, "text": decode_utf8(raw, "document text")})
        return [doc], False, on_conflict or "skip"
    if ctype != "application/json" and not ctype.endswith("+json"):
        raise APIError(415, f"unsupported content type {ctype!r}: send application/json or text/plain",
                       code="unsupported_media_type")
    payload = parse_json(raw)
    if isinstance(payload, dict) and "documents" in payload:
        batch = validate(DocumentBatchIn, payload)
        return batch.documents, True, batch.on_conflict or on_conflict or "skip"
    doc = validate(DocumentIn, payload)
    return [doc], False, on_conflict or "skip"


@router.post("/v1/documents")
async def create_documents(request: Request, wait: bool = False, id: str | None = None,
                           on_conflict: OnConflict | None = None) -> JSONResponse:
    st = _state(request)
    st.require_components()
    srv = st.settings.server
    docs, batch, default_conflict = _parse_documents(request, await request.body(), id, on_conflict)
    if len(docs) > srv.max_batch_documents:
        raise APIError(413, f"{len(docs)} documents exceed the batch limit of {srv.max_batch_documents}",
                       code="batch_too_large", param="documents")
    # Validate everything before queuing anything: a bad batch writes nothing.
    items: list[tuple[str, DocumentIn, str]] = []
    seen: set[str] = set()
    for i, d in enumerate(docs):
        param = f"documents.{i}.text" if batch else "text"
        if len(d.text) > srv.max_document_chars:
            raise APIError(413, f"document text has {len(d.text)} characters, over the limit of "
                           f"{srv.max_document_chars}", code="document_too_large", param=param)
        if not d.text.strip():
            raise APIError(422, "document text is empty or whitespace only", code="empty_document", param=param)
        doc_id = d.id or default_doc_id(d.text)
        if doc_id in seen:
            raise APIError(422, f"document id {doc_id!r} appears twice in the batch", code="duplicate_id",
                           param="documents")
        seen.add(doc_id)
        items.append((doc_id, d, d.on_conflict or default_conflict))
    for doc_id, _, policy in items:
        st.ingest.check_conflict(doc_id, policy)
    results = [st.ingest.submit(doc_id, d.text, dict(d.metadata), policy) for doc_id, d, policy in items]
    if wait:
        jobs = [job for job, _ in results if job is not None]
        if jobs:
            await asyncio.wait([asyncio.create_task(j.done.wait()) for j in jobs],
                               timeout=srv.ingest_wait_timeout_s)
        out = [job.to_json() if job is not None else item for job, item in results]
        if not batch:
            job = results[0][0]
            if job is not None and job.status == "failed":
                raise APIError(503 if job.worker_crashed else 500,
                               f"ingestion of {job.document_id!r} failed: {job.error}", code="ingest_failed")
            if job is not None and not job.done.is_set():
                return JSONResponse(out[0], status_code=202)
            return JSONResponse(out[0], status_code=201 if job is not None else 200)
        created = any(job is not None and job.status == "ready" for job, _ in results)
        pending = any(job is not None and not job.done.is_set() for job, _ in results)
        return JSONResponse({"documents": out}, status_code=202 if pending else 201 if created else 200)
    out = [item for _, item in results]
    status = 202 if any(job is not None for job, _ in results) else 200
    return JSONResponse({"documents": out} if batch else out[0], status_code=status)


@router.get("/v1/documents")
async def list_documents(request: Request, offset: int = Query(0, ge=0),
                         limit: int = Query(50, ge=1, le=1000)) -> dict:
    st = _state(request)
    st.require_components()
    page, total = await asyncio.to_thread(st.store.list_documents, offset=offset, limit=limit)
    return {"documents": [document_json(r, st.ingest.active.get(r.id)) for r in page], "total": total,
            "offset": offset, "limit": limit}


@router.get("/v1/documents/{doc_id}")
async def get_document(request: Request, doc_id: str, include_text: bool = False) -> dict:
    st = _state(request)
    st.require_components()
    rec = await asyncio.to_thread(st.store.get_document, doc_id)
    job = st.ingest.active.get(doc_id)
    if rec is None:
        if job is not None:  # queued, not written yet
            return {"id": doc_id, "status": job.status, "job": job.to_json()}
        raise APIError(404, f"document {doc_id!r} not found", code="document_not_found")
    out = document_json(rec, job)
    if include_text:
        out["text"] = await asyncio.to_thread(st.store.get_text, doc_id)
    return out


@router.delete("/v1/documents/{doc_id}")
async def delete_document(request: Request, doc_id: str) -> dict:
    st = _state(request)
    st.require_components()
    job = st.ingest.cancel(doc_id)
    if job is not None:
        # The ingestion rolls itself back at its next step; answer once it has.
        await asyncio.wait_for(job.done.wait(), _DELETE_WAIT_S)
        existed = True
    else:
        existed = await asyncio.to_thread(st.store.get_document, doc_id) is not None
        if not existed:
            raise APIError(404, f"document {doc_id!r} not found", code="document_not_found")
    await asyncio.to_thread(st.index_remove, doc_id)
    await asyncio.to_thread(st.store.delete_document, doc_id)
    st.refresh_document_gauge()
    return {"id": doc_id, "deleted": existed}


@router.get("/v1/jobs/{job_id}")
async def get_job(request: Request, job_id: str) -> dict:
    job = _state(request).ingest.jobs.get(job_id)
    if job is None:
        raise APIError(404, f"job {job_id!r} not found (jobs are kept in memory until a restart)",
                       code="job_not_found")
    return job.to_json()
