"""Ingestion jobs: chunk -> embed -> choose each chunk's precompute context -> precompute KV in the worker
-> swap the new version in -> `ready`.

Jobs are durable (kvfuse.store.jobs): each is written to LMDB, with its text, before the API answers
202, and a restart runs every unfinished job again from its text (chunks already stored are not
computed again). A job builds its version beside the stored one: its chunk keys are staged under the
job, the worker writes the blobs, and one LMDB transaction swaps the new record, text and refs in; the
vectors follow (job status `indexing` inside, `processing` outside, until they are in). Until the swap,
queries answer from the old version; a failure, or a DELETE meanwhile, releases the staged blobs and
leaves the old version as it was (a document with no good version gets a `failed` record with the
reason). A failure that passes (a worker crash, the document index down) is not the document's: the job
pauses and runs again from what LMDB holds of it, within the retry policy (ingest_retry.py), reporting
meanwhile that it waits and why. See docs/DESIGN.md, Durability.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from kvfuse import kvblob
from kvfuse.config import Settings
from kvfuse.service.dispatch.base import require_worker
from kvfuse.service.dispatch.job_book import WorkerCrashed, WorkerJobError, precompute
from kvfuse.service.errors import APIError
from kvfuse.service.rag.ingest_job import IngestJob, Submission, content_hash
from kvfuse.service.rag.ingest_queue import SERVICE, IngestQueue
from kvfuse.service.rag.ingest_retry import INDEX_UNAVAILABLE, WORKER_CRASHED, RetryPolicy, cause_of
from kvfuse.service.rag.precompute_context import context_sources, contexts_for, sequence_start
from kvfuse.service.wire.protocol import PrecomputeJob
from kvfuse.store.errors import IndexUnavailableError
from kvfuse.store.jobs import JobRecord, public_status
from kvfuse.store.records import KV_LOST, DocumentRecord

if TYPE_CHECKING:
    from kvfuse.service.metrics import Metrics
    from kvfuse.service.rag.corpus import Corpus

log = logging.getLogger(__name__)

_MAX_JOBS_KEPT = 10_000  # jobs kept in memory; older ones are read from the store
_PURGE_EVERY_S = 3600.0  # how often finished jobs past server.job_history_s are deleted


class IngestCancelled(Exception):
    """The document was deleted while it was being ingested."""


class IngestManager:
    """Runs ingestion jobs one document at a time (the worker is the bottleneck anyway)."""

    def __init__(self, settings: Settings, metrics: Metrics, dispatcher: Any) -> None:
        self.settings = settings
        self.metrics = metrics
        self.dispatcher = dispatcher
        self.corpus: Corpus | None = None  # attached once loaded, before `recover` and `start`
        self.policy = RetryPolicy.from_settings(settings.server)
        self.jobs: OrderedDict[str, IngestJob] = OrderedDict()
        self.active: dict[str, IngestJob] = {}  # document id -> its unfinished job
        self._queue = IngestQueue(settings.server)  # bounded, fair between API keys (ingest_queue.py)
        self._runner: asyncio.Task | None = None
        self._purged_at = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None

    def attach(self, corpus: Corpus) -> None:
        self.corpus = corpus

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._runner = asyncio.create_task(self._run(), name="kvfuse-ingest")

    async def stop(self) -> None:
        if self._runner is not None:
            self._runner.cancel()

    def recover(self) -> int:
        """Queue the jobs a previous run left unfinished, oldest first (call before `start`)."""
        self._purge()
        jobs = self.corpus.store.jobs.unfinished()
        for rec in jobs:
            log.info("resuming ingestion job %s of %s (was %s)", rec.id, rec.document_id, rec.status)
            self._register(IngestJob(rec))
        return len(jobs)

    def _purge(self) -> None:
        self._purged_at = time.time()
        n = self.corpus.store.jobs.purge(self.settings.server.job_history_s)
        if n:
            log.info("forgot %d finished jobs older than server.job_history_s", n)

    def get(self, job_id: str) -> IngestJob | JobRecord | None:
        job = self.jobs.get(job_id)
        return job if job is not None else self.corpus.store.jobs.get(job_id)

    def unfinished(self, doc_id: str) -> IngestJob | None:
        """The document's job while it runs. Its status turns final only once its end is stored (so a
        poll never reads `failed` before the document's `failed` record); from then it neither blocks a
        new version nor shows as running, though it leaves `active` a moment later."""
        job = self.active.get(doc_id)
        return job if job is not None and not job.finished else None

    # -- submission (synchronous: check and register with no await in between) -----------------------------
    def check_conflict(self, doc_id: str, on_conflict: str) -> None:
        """Raise 409 if `on_conflict` forbids ingesting `doc_id` now (a failed document counts as absent)."""
        if (running := self.unfinished(doc_id)) is not None:
            if on_conflict != "skip":
                raise APIError(409, f"document {doc_id!r} is being ingested (job {running.id})",
                               code="document_busy", param="id")
            return
        if on_conflict == "fail":
            existing = self.corpus.store.get_document(doc_id)
            if existing is not None and existing.status != "failed":
                raise APIError(409, f"document {doc_id!r} already exists (on_conflict=fail)",
                               code="document_exists", param="id")

    def check_room(self, owner: str, n: int = 1) -> None:
        """429 unless `n` more jobs of `owner` (the API key sending them) fit in the queue now."""
        self._queue.check_room(owner, n)

    def submit_all(self, items: list[tuple[str, str, dict, str, str]], owner: str = SERVICE, *,
                   precompute_at: dict[str, str] | None = None) -> list[tuple[IngestJob | None, Submission]]:
        """Queue a job per (doc id, text, metadata, on_conflict, collection) (after check_conflict, with no
        await in between); (None, item) when skipped (a document kept by `skip` stays in its collection).
        429 when the new jobs do not fit `owner`'s room in the queue (nothing is stored then). The jobs are
        stored in one transaction before this returns: a 202 is a promise that survives a restart.
        `precompute_at`: doc id -> the request's mode for it."""
        out: list[tuple[IngestJob | None, Submission]] = []
        new: list[IngestJob] = []
        for doc_id, text, metadata, on_conflict, collection in items:
            if (job := self.unfinished(doc_id)) is not None:
                out.append((None, Submission(document_id=doc_id, job_id=job.id, status=public_status(job.status),
                                            skipped=True)))
                continue
            existing = self.corpus.store.get_document(doc_id)
            if existing is not None and existing.status != "failed" and on_conflict == "skip":
                out.append((None, Submission(document_id=doc_id, job_id=None, status=existing.status, skipped=True)))
                continue
            job = IngestJob(JobRecord(id="job-" + uuid.uuid4().hex[:16], document_id=doc_id, text=text,
                                      metadata=metadata, collection=collection, created_at=time.time(),
                                      precompute_at=(precompute_at or {}).get(doc_id, "")))
            new.append(job)
            out.append((job, Submission(document_id=doc_id, job_id=job.id, status=job.status)))
        if new:
            self._queue.check_room(owner, len(new))
            try:
                self.corpus.store.jobs.put_many([j.rec for j in new])
            except Exception as err:  # noqa: BLE001 - nothing was promised yet
                raise APIError(503, f"the ingestion jobs could not be stored: {err}", code="store_unavailable") from err
            for job in new:
                self._register(job, owner)
        return out

    def resubmit(self, doc_id: str, reason: str) -> IngestJob | None:
        """Build a stored document again from its stored text (its KV is from another model, or lost);
        the stored version answers until the new one is in. None if a job is already on it."""
        if self.unfinished(doc_id) is not None:
            return None
        rec, text = self.corpus.store.get_document(doc_id), self.corpus.store.get_text(doc_id)
        if rec is None or not text:
            return None
        log.info("rebuilding %s from its stored text: %s", doc_id, reason)
        job, _ = self.submit_all([(doc_id, text, dict(rec.metadata), "overwrite", rec.collection)],
                                 precompute_at={doc_id: rec.precompute_at})[0]
        return job

    def resubmit_soon(self, doc_id: str, reason: str) -> None:
        """`resubmit` from any thread (a query prepared in a worker thread finds a stale document)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._resubmit_logged, doc_id, reason)

    def _resubmit_logged(self, doc_id: str, reason: str) -> None:
        try:
            self.resubmit(doc_id, reason)
        except Exception:  # noqa: BLE001 - the stored version still answers; retried at the next start
            log.exception("could not queue the rebuild of %s", doc_id)

    def stale_documents(self, fingerprint: str) -> list[tuple[str, str]]:
        """(doc id, why) of every document whose KV is from another model (its first blob's header says
        so) or was found lost (`kv_lost`). Reads the store: call it in a thread."""
        out = []
        for rec in self.corpus.all_documents():
            if rec.status == "ready" and rec.chunk_keys:
                found = self.corpus.store.blob_fingerprint(rec.chunk_keys[0])
                if found is not None and found != fingerprint:
                    out.append((rec.id, "its KV is from another model"))
            elif rec.status == "failed" and (rec.error or "").startswith(KV_LOST):
                out.append((rec.id, rec.error or KV_LOST))
        return out

    def _register(self, job: IngestJob, owner: str = SERVICE) -> None:
        """Queue a stored job. Its text stays in LMDB only until the job starts (`_attempt` reads it)."""
        job.rec.text = ""
        self.jobs[job.id] = job
        while len(self.jobs) > _MAX_JOBS_KEPT:
            self.jobs.popitem(last=False)
        self.active[job.document_id] = job
        self._queue.put(job, owner)

    def cancel(self, doc_id: str) -> IngestJob | None:
        """Stop the document's job: one still queued ends now; a running one at its next step."""
        job = self.active.get(doc_id)
        if job is None:
            return None
        job.cancelled = True
        job.woken.set()
        if job.rec.status == "pending" and not job.rec.staged_keys:  # not started: nothing to undo
            self.corpus.store.jobs.abandon(job.rec, "cancelled", "the document was deleted before ingestion")
            del self.active[doc_id]
            self._queue.discard(job)
            job.done.set()
        return job

    # -- the runner ----------------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            job = await self._queue.get()
            if job.done.is_set():  # cancelled while queued
                continue
            try:
                await self._ingest(job)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - _ingest records failures; this guards the runner itself
                log.exception("ingest runner error on %s", job.id)
            finally:
                if self.active.get(job.document_id) is job:
                    del self.active[job.document_id]
                job.done.set()
            if time.time() - self._purged_at > _PURGE_EVERY_S:
                await asyncio.to_thread(self._purge)

    def _check(self, job: IngestJob) -> None:
        if job.cancelled:
            raise IngestCancelled()

    async def _ingest(self, job: IngestJob) -> None:
        """Run the job to its end. A failure that passes (a worker crash, the document index down:
        ingest_retry.py) runs it again from what LMDB holds of it, within the retry policy; any other, or
        the last allowed, ends it `failed` with the reason."""
        try:
            while True:
                try:
                    await self._attempt(job)
                    return
                except IngestCancelled:
                    await self._end(job, "cancelled", "the document was deleted during ingestion")
                    return
                except Exception as err:  # noqa: BLE001 - every failure is retried or becomes the job's reason
                    if not await self._retry(job, err):
                        return
        finally:
            self.corpus.refresh_gauges(self.metrics)

    async def _attempt(self, job: IngestJob) -> None:
        """One try of the job, from where its record says it is."""
        corpus, rec, jobs = self.corpus, job.rec, self.corpus.store.jobs
        t0 = time.perf_counter()
        doc_id = job.document_id
        if not rec.text:  # queued without its text: read it back (the record as stored, with the text)
            await self._reload(job)
            rec = job.rec
        rec.waiting_for = None
        if rec.status == "indexing":  # swapped in before a restart or a retry: only the vectors are left
            await self._index(job, None, None)
            return
        self._check(job)
        rec.status = "processing"
        await asyncio.to_thread(jobs.put, rec)
        await require_worker(self.dispatcher, self.settings.server.worker_start_timeout_s)
        chunks = await asyncio.to_thread(corpus.chunker.chunk, rec.text)
        rec.chunks_total, rec.chunks_done = len(chunks), 0
        raw = [c.token_ids for c in chunks]
        ids = corpus.prompt_blocks(raw, corpus.prompt_name(rec))  # as fused: the labelled header cached too
        vectors = await asyncio.to_thread(corpus.embedder.embed, [c.text for c in chunks], background=True)
        self._check(job)
        contexts = await asyncio.to_thread(contexts_for, corpus, doc_id, raw, vectors, rec.collection)
        fp, hashes = self.dispatcher.info["fingerprint"], [kvblob.context_hash(c) for c in contexts]
        keys = [kvblob.chunk_key_from_hash(fp, self.settings.store.kv_dtype, kvblob.token_hash(t), h)
                for t, h in zip(ids, hashes, strict=True)]
        # Staged before any blob is written: the refs make every blob below the job's, so none is
        # ever an orphan.
        await asyncio.to_thread(jobs.stage, rec, keys)
        self._check(job)
        kv_bytes = 0
        batch = self.settings.server.precompute_batch_chunks
        at = rec.precompute_at or self.settings.store.precompute_at
        for i in range(0, len(ids) if at == "ingest" else 0, batch):  # first_use: computed when queried
            done = await precompute(self.dispatcher, PrecomputeJob(ids[i : i + batch],
                                                                 contexts=contexts[i : i + batch]))
            if done.keys != keys[i : i + batch]:
                raise RuntimeError("the worker computed other chunk keys than the API (model changed?)")
            kv_bytes += sum(done.nbytes)
            self.metrics.precomputed_chunks.inc(done.computed)
            rec.chunks_done = min(len(ids), i + batch)
            self._check(job)
        if at != "ingest":  # every step a first-use document takes is done; its KV is computed when queried
            rec.chunks_done = len(ids)
        doc = DocumentRecord(id=doc_id, status="ready", metadata=rec.metadata, collection=rec.collection,
                             chunk_keys=keys,
                             chunk_tokens=[len(t) for t in raw], tokens=sum(len(t) for t in raw),
                             chunk_contexts=hashes if any(hashes) else [],
                             chunk_context_src=(context_sources(raw, contexts, sequence_start(corpus))
                                                if any(hashes) else []),
                             precompute_at=at, kv_bytes=kv_bytes, content_hash=content_hash(rec.text))
        self._check(job)
        # The swap: from here the new version answers (a DELETE now deletes it, after this job ends).
        await asyncio.to_thread(jobs.commit, rec, doc, rec.text)
        await self._index(job, vectors, [c.text for c in chunks])
        log.info("ingested %s: %d chunks, %d tokens, %.2f s", doc_id, len(ids), doc.tokens,
                 time.perf_counter() - t0)

    async def _index(self, job: IngestJob, vectors: Any, texts: list[str] | None) -> None:
        """Replace the document's vectors and chunk texts in the retrieval indexes (chunked and embedded
        again from its stored text after a restart) and finish."""
        corpus, rec = self.corpus, job.rec
        if vectors is None or texts is None:
            text = await asyncio.to_thread(corpus.store.get_text, rec.document_id) or ""
            texts = [c.text for c in await asyncio.to_thread(corpus.chunker.chunk, text)]
            vectors = await asyncio.to_thread(corpus.embedder.embed, texts, background=True)
        await asyncio.to_thread(corpus.index_replace, rec.document_id, vectors, texts, rec.metadata, rec.collection)
        await asyncio.to_thread(corpus.store.jobs.finish, rec)

    async def _retry(self, job: IngestJob, err: Exception) -> bool:
        """After a failed try: True once the job may run again (its record reloaded from LMDB, the retry
        counted and stored, the pause waited, the index back if that was the cause); False when it ended
        (failed, or cancelled meanwhile)."""
        cause, reason = cause_of(err), _reason(err)
        tries = job.rec.retries.get(cause, 0) + 1 if cause else 0
        while True:
            if job.cancelled:
                await self._end(job, "cancelled", "the document was deleted during ingestion")
                return False
            if cause is None or self.policy.exhausted(cause, tries):
                final = f"{reason} (after {tries} attempt{'s' if tries > 1 else ''})" if cause else reason
                job.rec.worker_crashed = cause == WORKER_CRASHED
                log.warning("ingest of %s failed: %s", job.document_id, final)
                await self._end(job, "failed", final)
                return False
            await self._reload(job)
            rec, pause = job.rec, self.policy.pause(tries)
            rec.retries[cause] = tries
            rec.waiting_for = (f"retry {tries} of {self.policy.attempts[cause] - 1} in {pause:g} s, "
                               f"after: {reason}")
            log.warning("ingest of %s: %s", job.document_id, rec.waiting_for)
            await asyncio.to_thread(self.corpus.store.jobs.put, rec)
            try:
                await asyncio.wait_for(job.woken.wait(), pause)
            except TimeoutError:
                pass
            if cause != INDEX_UNAVAILABLE or await self.corpus.document_index_available():
                return True
            tries += 1  # the index still does not answer: that try failed too

    async def _reload(self, job: IngestJob) -> None:
        """Take the job's record as LMDB has it: a try may have stopped between its in-memory changes and
        their write (a swap committed in LMDB whose index write failed is `indexing` there)."""
        stored = await asyncio.to_thread(self.corpus.store.jobs.get, job.id)
        if stored is not None and not stored.finished:
            job.rec = stored

    async def _end(self, job: IngestJob, status: str, reason: str) -> None:
        """End the job without a new version (`failed` or `cancelled`): release the staged version; the
        stored one stays. A failed document with no good version (new, or failed before) gets a `failed`
        record that says why, with the text a retry can use. LMDB is read and written first, so the end is
        recorded also while a Redis index does not answer (the index catches up when it does)."""
        store, rec = self.corpus.store, job.rec
        try:
            failed = None
            if status == "failed":
                existing = await asyncio.to_thread(store.catalog.stored_document, rec.document_id)
                if existing is None or existing.status == "failed":
                    failed = DocumentRecord(id=rec.document_id, status="failed", metadata=rec.metadata,
                                            collection=rec.collection, error=reason, content_hash=content_hash(rec.text))
            await asyncio.to_thread(store.jobs.abandon, rec, status, reason, failed)
        except IndexUnavailableError as err:  # raised after the LMDB write, by the index's copy of it
            log.warning("job %s ended %s; the document index is behind until it answers again: %s", rec.id,
                        status, err)
        except Exception:  # noqa: BLE001 - the job already ended; log the secondary failure
            log.exception("could not record the end of %s", rec.id)
            rec.status, rec.error = status, reason


def _reason(err: Exception) -> str:
    if isinstance(err, WorkerCrashed):
        return f"worker crashed during KV precompute: {err}"
    if cause_of(err) == INDEX_UNAVAILABLE:
        return f"the document index is unavailable: {getattr(err, 'message', err)}"
    if isinstance(err, WorkerJobError):
        return f"KV precompute failed: {err.message}"
    if isinstance(err, APIError):
        return err.message
    return f"{type(err).__name__}: {err}"
