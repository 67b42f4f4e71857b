"""Response bodies of the HTTP API, one class per shape a client reads.

Endpoints declare these as `response_model`, so the OpenAPI schema at `/openapi.json` and the bytes on the
wire come from the same place. Extra fields may be added; the documented ones (docs/usage.md)
keep their names and meaning. A query answer is `QueryAnswer`: the JSON body of `POST /v1/query` and,
word for word, the data of the stream's final `done` event. Errors have their own model in errors.py; the
OpenAI endpoints' shapes are in openai_responses.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from kvfuse.config import DEFAULT_COLLECTION

if TYPE_CHECKING:
    from kvfuse.service.dispatch.supervisor import WorkerSupervisor
    from kvfuse.service.rag.ingest_job import IngestJob
    from kvfuse.store import DocumentRecord
    from kvfuse.store.jobs import JobRecord


def _is_none(value: Any) -> bool:
    return value is None


def _optional(description: str) -> Any:
    """A field left out of the JSON when it is None: it exists only in some answers (see its description)."""
    return Field(None, exclude_if=_is_none, description=description)


# -- documents and jobs ------------------------------------------------------------------------------------

class Progress(BaseModel):
    chunks_done: int
    chunks_total: int


class JobOut(BaseModel):
    """An ingestion job: `GET /v1/jobs/{id}`, a document's `job` while it is ingested, and what
    `POST /v1/documents?wait=true` answers for each document it ingested."""

    job_id: str
    document_id: str
    status: str = Field(description="pending | processing | ready | failed | cancelled")
    error: str | None
    created_at: float
    updated_at: float
    progress: Progress

    retries: dict[str, int] | None = _optional("retries so far by cause (worker_crashed, index_unavailable), "
                                               "once the job was retried")
    waiting_for: str | None = _optional("while the job pauses before its next try: which, and after what")
    kv_chunks: int | None = _optional("once its document is in: how many of its chunks hold KV (fewer than "
                                      "chunks_total under precompute_at first_use until queries or "
                                      "POST /v1/documents/{id}/precompute compute them)")
    status_url: str | None = _optional("where to follow the job: with ?wait=true answers that timed out")
    detail: str | None = _optional("what happened, when ?wait=true stopped waiting before the job ended")

    @classmethod
    def of(cls, job: IngestJob | JobRecord) -> JobOut:
        from kvfuse.store.jobs import public_status

        return cls(job_id=job.id, document_id=job.document_id, status=public_status(job.status), error=job.error,
                   created_at=job.created_at, updated_at=job.updated_at,
                   progress=Progress(chunks_done=job.chunks_done, chunks_total=job.chunks_total),
                   retries=dict(job.retries) or None, waiting_for=None if job.finished else job.waiting_for)


class Submitted(BaseModel):
    """One document of `POST /v1/documents` (202): the job now ingesting it, or, when skipped, the job
    already on it or the stored document's status (`on_conflict: skip`)."""

    document_id: str
    job_id: str | None
    status: str
    skipped: bool | None = _optional("true when nothing new was started for this document")


class SubmittedBatch(BaseModel):
    """`POST /v1/documents` with `{documents: [...]}`: one item per document, in request order."""

    documents: list[JobOut | Submitted]


class DocumentOut(BaseModel):
    """A document as stored (`GET /v1/documents/{id}`, items of the list)."""

    id: str
    status: str = Field(description="pending | processing | ready | failed")
    metadata: dict[str, Any] = {}
    collection: str = DEFAULT_COLLECTION
    chunks: int = 0
    tokens: int = 0
    kv_bytes: int = 0
    created_at: float = 0.0
    updated_at: float = 0.0
    error: str | None = None
    content_hash: str = ""
    precompute_at: str = Field("ingest", description=(
        "ingest (every chunk's KV computed before ready) | first_use (each chunk's KV computed when a query "
        "first needs it)"))
    kv_chunks: int | None = _optional("how many of its chunks hold KV now (GET /v1/documents/{id})")
    job: JobOut | None = _optional("the ingestion job, while one runs")
    text: str | None = _optional("the document's text, with ?include_text=true")

    @classmethod
    def of(cls, rec: DocumentRecord, job: IngestJob | None = None) -> DocumentOut:
        return cls(id=rec.id, status=rec.status, metadata=rec.metadata, collection=rec.collection,
                   chunks=len(rec.chunk_keys),
                   tokens=rec.tokens, kv_bytes=rec.kv_bytes, created_at=rec.created_at,
                   updated_at=rec.updated_at, error=rec.error, content_hash=rec.content_hash,
                   precompute_at=rec.precompute_at, job=None if job is None else JobOut.of(job))

    @classmethod
    def queued(cls, job: IngestJob) -> DocumentOut:
        """A document whose job has not written its record yet: only its id, status and job are known."""
        from kvfuse.store.jobs import public_status

        return cls(id=job.document_id, status=public_status(job.status), metadata=job.metadata,
                   collection=job.collection, created_at=job.created_at, updated_at=job.updated_at,
                   job=JobOut.of(job))


class DocumentPage(BaseModel):
    """`GET /v1/documents`: one page of documents; `total` counts every document."""

    documents: list[DocumentOut]
    total: int
    offset: int
    limit: int


class Deleted(BaseModel):
    id: str
    deleted: bool


class CollectionDeleted(BaseModel):
    collection: str
    deleted: int
    ids: list[str]


class Precomputed(BaseModel):
    """`POST /v1/documents/{id}/precompute` and `POST /v1/collections/{name}/precompute`: the chunk KV
    computed ahead of queries (the documents ingested with precompute_at first_use)."""

    documents: list[str] = Field(description="the ready documents it went over")
    chunks: int = Field(description="their chunks")
    computed: int = Field(description="chunks whose KV it computed (those no tier held)")
    kv_chunks: int = Field(description="chunks holding KV after it")


class FilterDeleted(BaseModel):
    """`POST /v1/documents/delete`: the documents the filter matched, deleted unless it was a dry run."""

    dry_run: bool
    matched: int
    deleted: int
    ids: list[str]


class CollectionOut(BaseModel):
    name: str
    documents: int = Field(description="ready documents (those queries search)")


class CollectionList(BaseModel):
    collections: list[CollectionOut]


# -- queries -----------------------------------------------------------------------------------------------

class Source(BaseModel):
    """A chunk that went into the prompt (or, in `dropped_sources`, one that did not fit)."""

    document_id: str
    chunk_index: int
    score: float = Field(description="the retrieval mode's score: cosine (dense), BM25 (keyword), reciprocal rank "
                                     "fusion (hybrid); 1.0 for documents named in document_ids")
    tokens: int
    dense_rank: int | None = Field(None, description="its rank (from 1) in the dense list; null: not in it")
    keyword_rank: int | None = Field(None, description="its rank (from 1) in the keyword list; null: not in it")
    text: str = Field("", description="the text the chunk covers of its document")
    metadata: dict[str, Any] = Field({}, description="its document's metadata")
    page: int | None = Field(None, description="the page (from 1) its text starts on, for a document ingested "
                                                "from a PDF; null otherwise")
    section: str | None = Field(None, description="the heading of the section its text starts in, for a document "
                                                  "ingested from a Markdown, HTML or DOCX file; null otherwise")

    label: int | None = Field(None, description=(
        "its number in the prompt, from 1: the [n] the labelled prompt (model.prompt_layout) gives it and an "
        "answer may cite; null for a dropped source"))


class SearchResults(BaseModel):
    """`POST /v1/search`: the chunks /v1/query would put in the prompt for the same knobs, best first."""

    results: list[Source]
    retrieval: RetrievalUsed
    retrieval_ms: float


class ChunkOut(BaseModel):
    """One chunk of a document, as `GET /v1/documents/{id}/chunks` lists it."""

    chunk_index: int
    text: str
    tokens: int
    page: int | None = Field(None, description="the page (from 1) its text starts on (PDF files); else null")
    section: str | None = Field(None, description="the heading of the section its text starts in (Markdown, "
                                                  "HTML, DOCX); else null")


class ChunkList(BaseModel):
    document_id: str
    collection: str
    metadata: dict[str, Any]
    chunks: list[ChunkOut]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    context_tokens: int = Field(description="the retrieved chunks' tokens")
    cached_tokens: int = Field(description="prompt tokens whose stored KV was reused unchanged")
    recomputed_tokens: int = Field(description="context tokens recomputed by the fusion method")
    chunks_read: int | None = _optional("chunks whose stored KV was read")
    chunks_computed: int | None = _optional(
        "chunks whose KV was computed for this query, after their recorded contexts: in no tier (first use, "
        "or evicted: then kept for the next query) or behind a tier slower than computing them")
    chunks_deferred: int | None = _optional(
        "chunks in no tier that this answer did not wait for: it came from a full prefill (fusion.method "
        "says vanilla) and they are computed after it, for the next query (fusion.cold_chunks)")


class Timings(BaseModel):
    """Milliseconds from the request's arrival: the parts, then time to first token and the total."""

    retrieval_ms: float
    queue_ms: float
    kv_load_ms: float
    assemble_ms: float
    select_ms: float
    recompute_ms: float
    kv_compute_ms: float = Field(0.0, description="of kv_load_ms: computing the chunks_computed")
    ttft_ms: float
    decode_ms: float
    total_ms: float


class FusionUsed(BaseModel):
    method: str
    recompute_ratio: float
    ratio_source: Literal["request", "config", "auto"] = Field("request", description=(
        "where the ratio came from: the request, the configuration, or held for fidelity.target_agreement"))
    size_bucket: str | None = Field(None, description="the prompt-size bucket an auto ratio was held for")
    requested_method: str | None = _optional(
        "the request's method when another ran: a query whose chunks were in no tier was answered by a full "
        "prefill (fusion.cold_chunks)")


class RetrievalUsed(BaseModel):
    mode: str = Field(description="dense | keyword | hybrid; explicit for documents named in document_ids")
    collections: list[str]


class QuerySources(BaseModel):
    """The stream's first event (`event: sources`), sent before generation starts."""

    sources: list[Source]
    dropped_sources: list[Source]
    warning: str | None = Field(description="set when retrieved chunks did not fit the context")
    fusion: FusionUsed
    retrieval: RetrievalUsed


class QueryAnswer(BaseModel):
    """A query answer: the body of `POST /v1/query`, and the stream's final event (`event: done`)."""

    answer: str
    finish_reason: str = Field(description="stop | length | cancelled")
    sources: list[Source]
    dropped_sources: list[Source]
    warning: str | None
    usage: Usage
    timings: Timings
    fusion: FusionUsed
    retrieval: RetrievalUsed
    worker: str | None = Field(None, description="the worker that served the answer (its fleet name, or host-pid)")


# -- service -----------------------------------------------------------------------------------------------

class WorkerHealth(BaseModel):
    pid: int | None
    ready: bool
    restarts: int
    last_error: str | None


class Health(BaseModel):
    """`GET /health`: will this server answer queries (kvfuse/service/health.py)? 200 with `ok` once it was
    ready, through transient outages; 503 with `starting` before that, `failed` when it never will. With
    API keys set, only a request with a valid key sees the reason and the worker's details (pid, last
    error): they may name hosts and paths."""

    status: Literal["ok", "starting", "failed"] = "ok"
    version: str
    reason: str | None = _optional("why it is starting or failed: without API keys, or with a valid key")
    worker: WorkerHealth | None = _optional("the worker's state: without API keys, or with a valid key")

    @classmethod
    def of(cls, version: str, status: str, reason: str | None, sup: WorkerSupervisor,
           details: bool = True) -> Health:
        if not details:
            return cls(status=status, version=version)
        return cls(status=status, version=version, reason=reason,
                   worker=WorkerHealth(pid=sup.pid, ready=sup.ready, restarts=sup.restarts, last_error=sup.last_error))


class Readiness(BaseModel):
    """`GET /ready`: 200 once every component is up; the 503 answer adds an `error` beside these."""

    ready: bool
    components: dict[str, bool]
    workers: list[dict[str, Any]] = []  # the live workers (`Dispatcher.live_workers`); valid key only
