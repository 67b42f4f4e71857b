"""Document and job endpoints: POST/GET/DELETE /v1/documents, GET/DELETE /v1/documents/{id}, POST
/v1/documents/delete (by filter),
GET /v1/collections, GET /v1/jobs/{id}."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING

from fastapi import APIRouter, Query, Request, Response

from kvfuse.config import DEFAULT_COLLECTION
from kvfuse.service.api.auth import Principal, client_key
from kvfuse.service.api.dependencies import Caller, ModelState, ReadyState, State
from kvfuse.service.api.errors import ERROR_RESPONSES
from kvfuse.service.api.responses import (
    CollectionDeleted,
    CollectionList,
    CollectionOut,
    Deleted,
    DocumentOut,
    DocumentPage,
    FilterDeleted,
    JobOut,
    Submitted,
    SubmittedBatch,
)
from kvfuse.service.api.schemas import (
    COLLECTION_PATTERN,
    DeleteByFilterIn,
    DocumentBatchIn,
    DocumentIn,
    OnConflict,
    PrecomputeAt,
    decode_utf8,
    documented_body,
    parse_json,
    validate,
)
from kvfuse.service.api.uploads import read_upload
from kvfuse.service.errors import APIError, collection_not_found, document_not_found
from kvfuse.service.rag.ingest_job import IngestJob, default_doc_id
from kvfuse.service.rag.retrieval import select

if TYPE_CHECKING:
    from kvfuse.service.state import ServiceState

router = APIRouter(responses=ERROR_RESPONSES)

_DELETE_WAIT_S = 30.0  # how long DELETE waits for a cancelled ingestion to roll back


async def _parse_documents(request: Request, state: ServiceState, raw: bytes, doc_id: str | None,
                           on_conflict: str | None, collection: str | None
                           ) -> tuple[list[DocumentIn], bool, str, str]:
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    default_collection = collection or DEFAULT_COLLECTION
    if ctype == "multipart/form-data":
        doc, form_conflict = await read_upload(request, doc_id, state.parsers)
        return [doc], False, form_conflict or on_conflict or "skip", default_collection
    if ctype == "text/plain":
        # A raw upload: the body is the text; id, on_conflict and collection come from the query string.
        doc = validate(DocumentIn, {"id": doc_id, "text": decode_utf8(raw, "document text")})
        return [doc], False, on_conflict or "skip", default_collection
    if ctype != "application/json" and not ctype.endswith("+json"):
        raise APIError(415, f"unsupported content type {ctype!r}: send application/json, text/plain or a file "
                       "as multipart/form-data",
                       code="unsupported_media_type")
    payload = parse_json(raw)
    if isinstance(payload, dict) and "documents" in payload:
        batch = validate(DocumentBatchIn, payload)
        if batch.precompute_at is not None:  # the batch's, for every document that names none
            batch.documents = [d if d.precompute_at else d.model_copy(update={"precompute_at": batch.precompute_at})
                               for d in batch.documents]
        return batch.documents, True, batch.on_conflict or on_conflict or "skip", batch.collection or default_collection
    doc = validate(DocumentIn, payload)
    return [doc], False, on_conflict or "skip", default_collection


@router.post("/v1/documents", status_code=202, response_model=JobOut | Submitted | SubmittedBatch,
             openapi_extra=documented_body(DocumentIn, DocumentBatchIn, text=True, upload=True))
async def create_documents(request: Request, response: Response, state: ModelState, caller: Caller,
                           wait: bool = False,
                           id: str | None = None, on_conflict: OnConflict | None = None,
                           collection: str | None = Query(None, pattern=COLLECTION_PATTERN),
                           precompute_at: PrecomputeAt | None = None,
                           ) -> JobOut | Submitted | SubmittedBatch:
    """Ingest one document or a batch. 202 with a job per document; with ?wait=true, 201 once stored (200
    when every document was skipped, 202 if waiting timed out). The body is JSON, or the raw text as
    text/plain (id, on_conflict and collection then come from the query string). A document goes to its
    own `collection`, else the batch's, else ?collection=, else `default`. A file (PDF, DOCX, HTML, Markdown,
    text) comes as multipart/form-data: its `file` field, with `id`, `collection`, `on_conflict` and
    `metadata` (a JSON object) as form fields (api/uploads.py). `precompute_at` (a document's, else the
    batch's, else ?precompute_at=, else `store.precompute_at`): `first_use` makes a document ready without
    its chunks' KV, computed when a query first needs it."""
    srv = state.settings.server
    owner = client_key(request)
    state.ingest.check_room(owner)  # a full queue answers 429 before the body is read or a file parsed
    docs, batch, default_conflict, default_collection = await _parse_documents(
        request, state, await request.body(), id, on_conflict, collection)
    if len(docs) > srv.max_batch_documents:
        raise APIError(413, f"{len(docs)} documents exceed the batch limit of {srv.max_batch_documents}",
                       code="batch_too_large", param="documents")
    # Validate everything before queuing anything: a bad batch writes nothing.
    items: list[tuple[str, DocumentIn, str, str]] = []
    seen: set[str] = set()
    for i, d in enumerate(docs):
        param = f"documents.{i}.text" if batch else "text"
        if len(d.text) > srv.max_document_chars:
            raise APIError(413, f"document text has {len(d.text)} characters, over the limit of "
                           f"{srv.max_document_chars}", code="document_too_large", param=param)
        if not d.text.strip():
            raise APIError(422, "document text is empty or whitespace only", code="empty_document", param=param)
        coll = d.collection or default_collection
        doc_id = d.id or default_doc_id(d.text, coll)
        if doc_id in seen:
            raise APIError(422, f"document id {doc_id!r} appears twice in the batch", code="duplicate_id",
                           param="documents")
        seen.add(doc_id)
        items.append((doc_id, d, d.on_conflict or default_conflict, coll))
    for doc_id, _, policy, coll in items:
        caller.check_write(coll)
        await _check_id_free(state, caller, doc_id)
        state.ingest.check_conflict(doc_id, policy)
    when = {doc_id: d.precompute_at or precompute_at for doc_id, d, _, _ in items if d.precompute_at or precompute_at}
    results = state.ingest.submit_all([(doc_id, d.text, dict(d.metadata), policy, coll)
                                       for doc_id, d, policy, coll in items], owner, precompute_at=when)
    jobs = [job for job, _ in results if job is not None]
    if not wait:
        response.status_code = 202 if jobs else 200
        out: list[JobOut | Submitted] = [Submitted(**dataclasses.asdict(item)) for _, item in results]
        return SubmittedBatch(documents=out) if batch else out[0]
    if jobs:
        await asyncio.wait([asyncio.create_task(j.done.wait()) for j in jobs], timeout=srv.ingest_wait_timeout_s)
    out = [_waited(request, state, job) if job is not None else Submitted(**dataclasses.asdict(item))
           for job, item in results]
    if not batch:
        job = results[0][0]
        if job is not None and job.status == "failed":
            state.require_model()  # the model failed while it waited: the same 503 as a new request gets
            raise APIError(503 if job.worker_crashed else 500,
                           f"ingestion of {job.document_id!r} failed: {job.error}", code="ingest_failed")
        response.status_code = 200 if job is None else 201 if job.done.is_set() else 202
        return out[0]
    created = any(job.status == "ready" for job in jobs)
    pending = any(not job.done.is_set() for job in jobs)
    response.status_code = 202 if pending else 201 if created else 200
    return SubmittedBatch(documents=out)


async def _check_id_free(state: ServiceState, caller: Principal, doc_id: str) -> None:
    """Ids are global: a scoped key must not overwrite (or skip onto) a document of a collection it does
    not see. It learns that the id is taken, nothing of the document."""
    if caller.scoped and (owner := await _owner(state, doc_id)) is not None and not caller.sees(owner):
        raise APIError(409, f"document id {doc_id!r} is taken: choose another", code="id_taken", param="id")


async def _owner(state: ServiceState, doc_id: str) -> str | None:
    """The collection of the document (stored, or still being ingested); None when there is none."""
    if (job := state.ingest.unfinished(doc_id)) is not None:
        return job.rec.collection
    rec = await asyncio.to_thread(state.corpus.store.get_document, doc_id)
    return None if rec is None else rec.collection


def _waited(request: Request, state: ServiceState, job: IngestJob) -> JobOut:
    """A job after ?wait=true: one still running says so, and where to follow it."""
    out = JobOut.of(job)
    if not job.done.is_set():
        out.status_url = str(request.url_for("get_job", job_id=job.id))
        ahead = sum(1 for j in state.ingest.active.values() if j.created_at < job.created_at)
        timeout_s = state.settings.server.ingest_wait_timeout_s
        out.detail = (f"job {job.id} is still {out.status} after waiting {timeout_s:g} s "
                      f"(server.ingest_wait_timeout_s; {ahead} earlier ingestion jobs were still unfinished); "
                      f"it goes on: follow it at {out.status_url}")
    return out


@router.get("/v1/documents")
async def list_documents(state: ReadyState, caller: Caller, offset: int = Query(0, ge=0),
                         limit: int = Query(50, ge=1, le=1000),
                         collection: str | None = Query(None, pattern=COLLECTION_PATTERN)) -> DocumentPage:
    """A page of documents in creation order; of one collection with ?collection= (404 if it has none).
    A key limited to collections lists only theirs."""
    if collection is not None:
        caller.check_collection(collection)
    if collection is None and caller.allowed_collections is not None:
        page, total = await asyncio.to_thread(_list_of, state, sorted(caller.allowed_collections), offset, limit)
    else:
        page, total = await asyncio.to_thread(state.corpus.store.list_documents, offset=offset, limit=limit,
                                              collection=collection)
    if collection is not None and total == 0:
        raise collection_not_found(collection)
    return DocumentPage(documents=[DocumentOut.of(r, state.ingest.unfinished(r.id)) for r in page], total=total,
                        offset=offset, limit=limit)


def _list_of(state: ServiceState, collections: list[str], offset: int, limit: int) -> tuple[list, int]:
    """One page over several collections in creation order: each collection's first offset + limit
    documents, merged (a scoped key's listing; a key holds few collections)."""
    recs: list = []
    total = 0
    for name in collections:
        page, n = state.corpus.store.list_documents(offset=0, limit=offset + limit, collection=name)
        recs.extend(page)
        total += n
    recs.sort(key=lambda r: r.created_at)
    return recs[offset:offset + limit], total


@router.delete("/v1/documents")
async def delete_collection(state: ReadyState, caller: Caller,
                            collection: str = Query(..., pattern=COLLECTION_PATTERN)) -> CollectionDeleted:
    """Delete every document of a collection (?collection= is required: no call deletes everything)."""
    caller.check_write()
    caller.check_collection(collection)
    ids: list[str] = []
    while True:  # listed anew each round: a page from a shrinking listing would skip documents
        page, _ = await asyncio.to_thread(state.corpus.store.list_documents, offset=len(ids), limit=500,
                                          collection=collection)
        if not page:
            break
        ids.extend(r.id for r in page)
    ids.extend(d for d, job in state.ingest.active.items() if job.rec.collection == collection and d not in ids)
    if not ids:
        raise collection_not_found(collection)
    for doc_id in ids:
        await _delete(state, doc_id)
    return CollectionDeleted(collection=collection, deleted=len(ids), ids=ids)


@router.post("/v1/documents/delete", openapi_extra=documented_body(DeleteByFilterIn))
async def delete_by_filter(request: Request, state: ReadyState, caller: Caller) -> FilterDeleted:
    """Delete the ready documents whose metadata passes `filters` (within `collections`, default all that
    the key sees). A dry run unless `dry_run: false`: first see which ids would go, then send the same body
    with it. A read-only key gets 403; collections the key does not see match nothing."""
    body = validate(DeleteByFilterIn, parse_json(await request.body()))
    caller.check_write()
    collections = body.collections
    if caller.allowed_collections is not None:
        collections = caller.visible(collections if collections is not None else sorted(caller.allowed_collections))
    ids = await asyncio.to_thread(select, state.corpus, filters=body.filters, collections=collections)
    if not body.dry_run:
        for doc_id in ids:
            await _delete(state, doc_id)
    return FilterDeleted(dry_run=body.dry_run, matched=len(ids), deleted=0 if body.dry_run else len(ids), ids=ids)


@router.get("/v1/collections")
async def list_collections(state: ReadyState, caller: Caller) -> CollectionList:
    """Collections that have ready documents (what queries can search), with their counts; those the
    key sees."""
    counts = await asyncio.to_thread(state.corpus.index.collections)
    return CollectionList(collections=[CollectionOut(name=n, documents=counts[n]) for n in caller.visible(counts)])


@router.get("/v1/documents/{doc_id}")
async def get_document(state: ReadyState, caller: Caller, doc_id: str, include_text: bool = False) -> DocumentOut:
    rec = await asyncio.to_thread(state.corpus.store.get_document, doc_id)
    job = state.ingest.unfinished(doc_id)
    owner = job.rec.collection if job is not None else rec.collection if rec is not None else None
    if owner is None:
        raise document_not_found(doc_id)
    caller.check_document(doc_id, owner)
    if rec is None:  # queued, not written yet
        return DocumentOut.queued(job)
    out = DocumentOut.of(rec, job)
    if rec.status == "ready":
        out.kv_chunks = await asyncio.to_thread(state.corpus.store.stored_chunks, rec.chunk_keys)
    if include_text:
        out.text = await asyncio.to_thread(state.corpus.store.get_text, doc_id)
    return out


@router.delete("/v1/documents/{doc_id}")
async def delete_document(state: ReadyState, caller: Caller, doc_id: str) -> Deleted:
    caller.check_write()
    if (owner := await _owner(state, doc_id)) is not None:  # none: _delete answers 404
        caller.check_document(doc_id, owner)
    return Deleted(id=doc_id, deleted=await _delete(state, doc_id))


async def _delete(state: ServiceState, doc_id: str) -> bool:
    """Cancel the document's ingestion, if one runs, then delete it from the indexes and the store."""
    job = state.ingest.cancel(doc_id)
    if job is not None:
        # The ingestion rolls itself back at its next step; answer once it has.
        await asyncio.wait_for(job.done.wait(), _DELETE_WAIT_S)
        existed = True
    else:
        existed = await asyncio.to_thread(state.corpus.store.get_document, doc_id) is not None
        if not existed:
            raise document_not_found(doc_id)
    await asyncio.to_thread(state.corpus.index_remove, doc_id)
    await asyncio.to_thread(state.corpus.store.delete_document, doc_id)
    state.refresh_document_gauge()
    return existed


@router.get("/v1/jobs/{job_id}")
async def get_job(state: State, caller: Caller, job_id: str) -> JobOut:
    job = await asyncio.to_thread(state.ingest.get, job_id)
    if job is None or not caller.sees(job.collection):
        raise APIError(404, f"job {job_id!r} not found (finished jobs are kept for server.job_history_s = "
                       f"{state.settings.server.job_history_s:g} s)", code="job_not_found")
    out = JobOut.of(job)
    if out.status == "ready":
        rec = await asyncio.to_thread(state.corpus.store.get_document, job.document_id)
        if rec is not None and rec.status == "ready":
            out.kv_chunks = await asyncio.to_thread(state.corpus.store.stored_chunks, rec.chunk_keys)
    return out
