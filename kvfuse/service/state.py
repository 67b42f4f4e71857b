"""`ServiceState`: everything the API process holds, created once per app by its lifespan.

Routes receive it through the dependencies in dependencies.py. The store, vector and keyword indexes,
embedder and tokenizer-only chunker load in the background, so `/health` answers at once and `/ready` says 503 until
every piece is up; until then they are None, and `require_components()` (the `ReadyState` dependency)
turns a request that needs them into a 503.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvfuse.config import Settings
from kvfuse.service.dispatch import make_dispatcher, open_api_store
from kvfuse.service.errors import APIError
from kvfuse.service.ingest import IngestManager
from kvfuse.service.metrics import Metrics
from kvfuse.service.query import QueryService

if TYPE_CHECKING:
    import numpy as np

    from kvfuse.retriever import Chunker, Embedder, VectorIndex
    from kvfuse.retriever.keyword_index import KeywordIndex
    from kvfuse.store import DocumentRecord, KVStore

log = logging.getLogger(__name__)

_INDEX_RETRY_FIRST_S = 0.5  # first pause before retrying a document index (Redis) that is not up
_INDEX_RETRY_MAX_S = 10.0  # the pause doubles up to this


class ServiceState:
    """The API process's settings, worker supervisor, metrics, ingestion jobs, query pipeline and, once
    loaded, its store, vector index, embedder and chunker."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.started_at = time.time()
        self.metrics = Metrics()
        self.supervisor = make_dispatcher(settings, self.metrics)  # local worker or fleet (dispatch.py)
        self.ingest = IngestManager(self)
        self.queries = QueryService(self)
        self.store: KVStore | None = None
        self.index: VectorIndex | None = None
        self.keyword: KeywordIndex | None = None
        self.embedder: Embedder | None = None
        self.chunker: Chunker | None = None
        self.startup_error: str | None = None
        self.waiting_for: str | None = None  # what startup is waiting for (a Redis not up yet)
        self._stopping = threading.Event()
        self._loader: asyncio.Task | None = None
        self._watch_model: asyncio.Task | None = None
        self._components = asyncio.Event()

    # -- lifecycle -----------------------------------------------------------------------------------------
    async def start(self) -> None:
        # The worker starts first: loading the LLM is the slowest part and runs in its own process.
        await self.supervisor.start()
        self._loader = asyncio.create_task(self._load(), name="kvfuse-load")

    async def _load(self) -> None:
        try:
            await asyncio.to_thread(self._load_components)
            self.ingest.recover()
            self.ingest.start()
            self._components.set()
            self._watch_model = asyncio.create_task(self._on_model(), name="kvfuse-model-check")
            self.refresh_document_gauge()
            log.info("store, index and embedder ready")
        except Exception as err:  # noqa: BLE001 - surfaced by /ready and every request
            self.startup_error = f"{type(err).__name__}: {err}"
            log.exception("service failed to start")

    async def _on_model(self) -> None:
        """Once the worker reports its model: record its fingerprint in the store (what `kvfuse store
        check` compares blob headers with) and rebuild the documents built for another model."""
        while not await self.supervisor.wait_ready(self.settings.server.worker_start_timeout_s):
            pass
        fp = self.supervisor.info["fingerprint"]
        try:
            await asyncio.to_thread(self.store.set_model_fingerprint, fp)
            stale = await asyncio.to_thread(self.ingest.stale_documents, fp)
            n = sum(self.ingest.resubmit(doc_id, why) is not None for doc_id, why in stale)
            if n:
                log.warning("%d documents have KV of another model or lost KV: rebuilding them", n)
        except Exception:  # noqa: BLE001 - queries still rebuild stale KV one chunk at a time
            log.exception("could not check the stored KV against the model")

    def _load_components(self) -> None:
        from kvfuse.model_files import resolve_embedder, resolve_llm
        from kvfuse.retriever import Chunker, Embedder

        s = self.settings
        # The hot tier of decoded KV lives in the worker, which reads KV; here it would only waste RAM.
        api_settings = s.model_copy(update={"store": s.store.model_copy(update={"hot_tier_mb": 0})})
        self.store = self._open_store(api_settings)
        self.chunker = Chunker.from_pretrained(resolve_llm(s.model.llm, s.models_dir), s.retriever.chunk_tokens)
        self.embedder = Embedder(resolve_embedder(s.model.embedder), device="cpu",
                                 batch_size=s.model.embed_batch_size)
        self.index = self._open_index()
        self.keyword = self._open_keyword_index()
        self._reconcile()

    def _open_store(self, settings: Settings) -> KVStore:
        """Open the store, waiting for its index: a Redis that is not up yet is retried with a growing
        pause (`/ready` says what it waits for), so the service becomes ready when Redis comes."""
        from kvfuse.store import IndexUnavailableError

        pause, attempt = _INDEX_RETRY_FIRST_S, 0
        while True:
            try:
                store = open_api_store(settings)
                self.waiting_for = None
                return store
            except IndexUnavailableError as err:
                attempt += 1
                self.waiting_for = f"the document index (Redis): attempt {attempt} failed, next in {pause:g} s"
                log.warning("waiting for %s: %s", self.waiting_for, err)
                if self._stopping.wait(pause):
                    raise RuntimeError("the service stopped while waiting for the document index") from None
                pause = min(pause * 2, _INDEX_RETRY_MAX_S)

    def _open_index(self) -> VectorIndex:
        from kvfuse.retriever import VectorIndex
        from kvfuse.retriever.errors import IndexLoadError

        s = self.settings
        try:
            return VectorIndex.open(s.faiss_dir, self.embedder.dim, s.retriever)
        except IndexLoadError as err:
            log.warning("vector index unusable (%s): rebuilding it from the stored documents", err)
            index = VectorIndex(s.faiss_dir, self.embedder.dim, s.retriever)
            index.rebuild(self._embedded_documents())
            index.save()
            return index

    def _open_keyword_index(self) -> KeywordIndex:
        from kvfuse.retriever.errors import IndexLoadError
        from kvfuse.retriever.keyword_index import KeywordIndex

        s = self.settings
        try:
            return KeywordIndex.open(s.keyword_dir, s.retriever)
        except IndexLoadError as err:
            log.warning("keyword index unusable (%s): rebuilding it from the stored documents' text", err)
            index = KeywordIndex(s.keyword_dir, s.retriever)
            index.rebuild((doc_id, texts) for doc_id, texts, _ in self._chunked_documents())
            index.save()
            return index

    def all_documents(self) -> list[DocumentRecord]:
        docs, offset = [], 0
        while True:
            page, total = self.store.list_documents(offset=offset, limit=500)
            docs.extend(page)
            offset += len(page)
            if not page or offset >= total:
                return docs

    def _chunked_documents(self, only: set[str] | None = None) -> Iterator[tuple[str, list[str], DocumentRecord]]:
        """(id, chunk texts, record) of every ready document (of `only`, if given), chunked again from its
        stored text."""
        for rec in self.all_documents():
            if rec.status != "ready" or (only is not None and rec.id not in only):
                continue
            text = self.store.get_text(rec.id)
            if text is None:
                continue
            yield rec.id, [c.text for c in self.chunker.chunk(text)], rec

    def _embedded_documents(self) -> Iterator[tuple[str, np.ndarray, dict, str]]:
        """(id, chunk vectors, metadata, collection) of every ready document, re-embedded from its text."""
        for doc_id, texts, rec in self._chunked_documents():
            yield doc_id, self.embedder.embed(texts), rec.metadata, rec.collection

    def _reconcile(self) -> None:
        """After a crash: the index holds exactly the ready documents. (Unfinished jobs resume from the
        store; a document record left pending by an older version without durable jobs is failed.)"""
        docs = self.all_documents()
        for rec in docs:
            if rec.status in ("pending", "processing"):
                log.warning("document %s was interrupted during ingestion: marking it failed", rec.id)
                text = self.store.get_text(rec.id) or ""
                self.store.delete_document(rec.id)
                rec.status, rec.error = "failed", "ingestion was interrupted by a restart; send it again"
                rec.chunk_keys, rec.chunk_tokens, rec.tokens, rec.kv_bytes = [], [], 0, 0
                self.store.put_document(rec, text)
        ready = {r.id: len(r.chunk_keys) for r in docs if r.status == "ready"}
        report = self.index.check(ready)
        if not report.ok:
            for doc_id in report.extra:
                self.index.remove(doc_id)
            if report.missing or report.mismatched:
                self.index.rebuild(self._embedded_documents())
            self.index.save()
        report = self.keyword.check(ready)
        if not report.ok:  # only the documents that differ: chunking again is cheap, embedding is not needed
            for doc_id in report.extra:
                self.keyword.remove(doc_id)
            for doc_id, texts, _ in self._chunked_documents(set(report.missing) | set(report.mismatched)):
                self.keyword.add(doc_id, texts)
            self.keyword.save()

    async def stop(self) -> None:
        self._stopping.set()
        await self.ingest.stop()
        for task in (self._loader, self._watch_model):
            if task is not None:
                task.cancel()
        await self.supervisor.stop()
        if self.index is not None:
            await asyncio.to_thread(self.index.save)
        if self.keyword is not None:
            await asyncio.to_thread(self.keyword.save)
        if self.store is not None:
            self.store.close()

    # -- readiness -----------------------------------------------------------------------------------------
    def readiness(self, document_index: bool = True) -> dict[str, bool]:
        """Which parts are up; `document_index` is whether the store's index answers now (Redis). `index`
        covers both retrieval indexes (vector and keyword)."""
        return {"store": self.store is not None,
                "index": self.index is not None and self.keyword is not None and self._components.is_set(),
                "embedder": self.embedder is not None, "model": self.supervisor.ready,
                "document_index": self.store is not None and document_index}

    async def document_index_available(self) -> bool:
        """Whether the store's document index (Redis, when configured) answers now."""
        if self.store is None:
            return False
        try:
            return await asyncio.to_thread(self.store.catalog.index_available)
        except Exception:  # noqa: BLE001 - any failure means not available
            return False

    def require_components(self) -> None:
        """Raise 503 until store, index and embedder are loaded."""
        if self.startup_error:
            raise APIError(503, f"the service failed to start: {self.startup_error}", code="startup_failed")
        if not self._components.is_set():
            raise APIError(503, "the service is starting", code="not_ready",
                           headers={"Retry-After": str(max(1, self.settings.server.retry_after_s))})

    async def supervisor_ready(self) -> None:
        if not await self.supervisor.wait_ready(self.settings.server.worker_start_timeout_s):
            raise APIError(503, f"the model worker is not ready: {self.supervisor.last_error or 'starting'}",
                           code="worker_unavailable")

    # -- index writes (always saved: the indexes on disk must match the store after any commit) -------------
    def index_replace(self, doc_id: str, vectors: np.ndarray, texts: list[str], metadata: dict,
                      collection: str) -> None:
        """A document's new version in both retrieval indexes (vectors and chunk texts, row i = chunk i) in
        place of the old one, each saved once. A crash between the two saves leaves the keyword index
        behind the store: the startup check (`_reconcile`) adds what it lacks from the stored text."""
        self.index.add(doc_id, vectors, metadata, collection)
        self.index.save()
        self.keyword.add(doc_id, texts)
        self.keyword.save()

    def index_remove(self, doc_id: str) -> None:
        if self.index.remove(doc_id):
            self.index.save()
        if self.keyword.remove(doc_id):
            self.keyword.save()

    def refresh_document_gauge(self) -> None:
        if self.store is not None:
            try:
                stats = self.store.stats()
                self.metrics.documents.set(stats["documents"])
                self.metrics.kv_chunks.set(stats["chunks"])
                self.metrics.kv_bytes.set(stats["kv_bytes"])
            except Exception:  # noqa: BLE001 - a gauge must never fail a request
                log.debug("store stats unavailable", exc_info=True)
