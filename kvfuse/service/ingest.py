"""Ingestion jobs: chunk -> embed -> precompute KV in the worker -> store + vector index -> `ready`.

Ordering makes a failure roll back cleanly: the document record (with its chunk keys, so the store
counts references to those blobs) and its text are written first, the blobs next (by the worker), the
vectors last. Any failure, or a DELETE meanwhile, removes the vectors and the document (which frees blobs
no other document uses) and leaves a `failed` record with the reason. Jobs live in memory; documents and
their status persist in the store.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvfuse.service.errors import APIError
from kvfuse.service.responses import Submitted
from kvfuse.service.supervisor import WorkerCrashed, WorkerJobError

if TYPE_CHECKING:
    from kvfuse.service.state import ServiceState

log = logging.getLogger(__name__)

_MAX_JOBS_KEPT = 10_000  # finished jobs remembered for GET /v1/jobs/{id}


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def default_doc_id(text: str) -> str:
    """A missing id becomes the content hash (so re-sending the same text finds the same document)."""
    return "sha256-" + content_hash(text)[:32]


@dataclass(eq=False)
class IngestJob:
    id: str
    document_id: str
    text: str
    metadata: dict
    overwrite: bool
    status: str = "pending"  # pending | processing | ready | failed | cancelled
    error: str | None = None
    worker_crashed: bool = False  # the failure was the worker dying (retryable: 503), not the document
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    chunks_total: int = 0
    chunks_done: int = 0
    cancelled: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def set(self, status: str, error: str | None = None) -> None:
        self.status, self.error, self.updated_at = status, error, time.time()


class Cancelled(Exception):
    """The document was deleted while it was being ingested."""


class IngestManager:
    """Runs ingestion jobs one document at a time (the worker is the bottleneck anyway)."""

    def __init__(self, state: ServiceState) -> None:
        self.state = state
        self.jobs: OrderedDict[str, IngestJob] = OrderedDict()
        self.active: dict[str, IngestJob] = {}  # document id -> its pending/processing job
        self._queue: asyncio.Queue[IngestJob] = asyncio.Queue()
        self._runner: asyncio.Task | None = None

    def start(self) -> None:
        self._runner = asyncio.create_task(self._run(), name="kvfuse-ingest")

    async def stop(self) -> None:
        if self._runner is not None:
            self._runner.cancel()

    # -- submission (synchronous: check and register with no await in between) -----------------------------
    def check_conflict(self, doc_id: str, on_conflict: str) -> None:
        """Raise 409 if `on_conflict` forbids ingesting `doc_id` now (a failed document counts as absent)."""
        if doc_id in self.active:
            if on_conflict != "skip":
                raise APIError(409, f"document {doc_id!r} is being ingested (job {self.active[doc_id].id})",
                               code="document_busy", param="id")
            return
        if on_conflict == "fail":
            existing = self.state.store.get_document(doc_id)
            if existing is not None and existing.status != "failed":
                raise APIError(409, f"document {doc_id!r} already exists (on_conflict=fail)",
                               code="document_exists", param="id")

    def submit(self, doc_id: str, text: str, metadata: dict, on_conflict: str) -> tuple[IngestJob | None, Submitted]:
        """Queue a job (after check_conflict, with no await in between); (None, item) when skipped."""
        if doc_id in self.active:
            job = self.active[doc_id]
            return None, Submitted(document_id=doc_id, job_id=job.id, status=job.status, skipped=True)
        existing = self.state.store.get_document(doc_id)
        if existing is not None and existing.status != "failed" and on_conflict == "skip":
            return None, Submitted(document_id=doc_id, job_id=None, status=existing.status, skipped=True)
        job = IngestJob(id="job-" + uuid.uuid4().hex[:16], document_id=doc_id, text=text, metadata=metadata,
                        overwrite=existing is not None)
        self.jobs[job.id] = job
        while len(self.jobs) > _MAX_JOBS_KEPT:
            self.jobs.popitem(last=False)
        self.active[doc_id] = job
        self._queue.put_nowait(job)
        return job, Submitted(document_id=doc_id, job_id=job.id, status=job.status)

    def cancel(self, doc_id: str) -> IngestJob | None:
        job = self.active.get(doc_id)
        if job is not None:
            job.cancelled = True
        return job

    # -- the runner ----------------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            job = await self._queue.get()
            try:
                await self._ingest(job)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - _ingest records failures; this guards the runner itself
                log.exception("ingest runner error on %s", job.id)
            finally:
                self.active.pop(job.document_id, None)
                job.done.set()

    def _check(self, job: IngestJob) -> None:
        if job.cancelled:
            raise Cancelled()

    async def _ingest(self, job: IngestJob) -> None:
        from kvfuse import kvblob
        from kvfuse.store.records import DocumentRecord

        st = self.state
        t0 = time.perf_counter()
        doc_id = job.document_id
        self._check(job)
        job.set("processing")
        added_vectors = False
        try:
            if job.overwrite:
                await self._remove(doc_id)
            await st.supervisor_ready()
            chunks = await asyncio.to_thread(st.chunker.chunk, job.text)
            job.chunks_total = len(chunks)
            ids = [c.token_ids for c in chunks]
            fp = st.supervisor.info["fingerprint"]
            keys = [kvblob.chunk_key(fp, st.settings.store.kv_dtype, t) for t in ids]
            record = DocumentRecord(id=doc_id, status="processing", metadata=job.metadata, chunk_keys=keys,
                                    chunk_tokens=[len(t) for t in ids], tokens=sum(len(t) for t in ids),
                                    content_hash=content_hash(job.text))
            # Record and text first: the chunk references make any blob below owned by this document.
            await asyncio.to_thread(st.store.put_document, record, job.text)
            self._check(job)
            vectors = await asyncio.to_thread(st.embedder.embed, [c.text for c in chunks])
            self._check(job)
            kv_bytes = 0
            batch = st.settings.server.precompute_batch_chunks
            for i in range(0, len(ids), batch):
                done = await st.supervisor.run("precompute", {"chunks": ids[i : i + batch]})
                if done.get("keys") != keys[i : i + batch]:
                    raise RuntimeError("the worker computed other chunk keys than the API (model changed?)")
                kv_bytes += sum(done["nbytes"])
                st.metrics.precomputed_chunks.inc(done.get("computed", 0))
                job.chunks_done = min(len(ids), i + batch)
                self._check(job)
            await asyncio.to_thread(st.index_add, doc_id, vectors, job.metadata)
            added_vectors = True
            self._check(job)
            await asyncio.to_thread(st.store.set_status, doc_id, "ready", kv_bytes=kv_bytes)
            self._check(job)  # a DELETE that raced the commit still wins
            job.set("ready")
            log.info("ingested %s: %d chunks, %d tokens, %.2f s", doc_id, len(ids), record.tokens,
                     time.perf_counter() - t0)
        except Cancelled:
            await self._rollback(doc_id, added_vectors, None)
            job.set("cancelled", "the document was deleted during ingestion")
        except Exception as err:  # noqa: BLE001 - every failure becomes the job's reason
            reason = _reason(err)
            job.worker_crashed = isinstance(err, WorkerCrashed)
            log.warning("ingest of %s failed: %s", doc_id, reason)
            await self._rollback(doc_id, added_vectors, (job, reason))
            job.set("failed", reason)
        finally:
            st.refresh_document_gauge()

    async def _remove(self, doc_id: str) -> None:
        st = self.state
        await asyncio.to_thread(st.index_remove, doc_id)
        await asyncio.to_thread(st.store.delete_document, doc_id)

    async def _rollback(self, doc_id: str, added_vectors: bool, failure: tuple[IngestJob, str] | None) -> None:
        from kvfuse.store.records import DocumentRecord

        st = self.state
        try:
            if added_vectors or doc_id in st.index.document_ids():
                await asyncio.to_thread(st.index_remove, doc_id)
            await asyncio.to_thread(st.store.delete_document, doc_id)
            if failure is not None:
                job, reason = failure
                # Keep a record that says why (no chunks, no blobs); its text is kept so a retry can use it.
                rec = DocumentRecord(id=doc_id, status="failed", metadata=job.metadata, error=reason,
                                     content_hash=content_hash(job.text))
                await asyncio.to_thread(st.store.put_document, rec, job.text)
        except Exception:  # noqa: BLE001 - the job already failed; log the secondary failure
            log.exception("rollback of %s failed", doc_id)


def _reason(err: Exception) -> str:
    if isinstance(err, WorkerCrashed):
        return f"worker crashed during KV precompute: {err}"
    if isinstance(err, WorkerJobError):
        return f"KV precompute failed: {err.message}"
    if isinstance(err, APIError):
        return err.message
    return f"{type(err).__name__}: {err}"
