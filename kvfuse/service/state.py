"""`ServiceState`: the composition root of the API process, created once per app by its lifespan.

It builds the parts and hands each its collaborators (settings, metrics, the dispatcher, the corpus),
starts and stops them, and says what is ready. Routes receive it through api/dependencies.py; nothing
below the API takes it. The corpus (store, indexes, embedder, tokenizer-only chunker) loads in the
background, so `/health` answers at once and `/ready` says 503 until every piece is up; until then
`require_components()` (the `ReadyState` and `Queries` dependencies) turns a request that needs them into
a 503. `health()` is the container's view (kvfuse/service/health.py): starting until the service was
ready once, then ok, or failed for good when the store or the worker can never start.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import TYPE_CHECKING

from kvfuse.config import Settings
from kvfuse.service.dispatch.base import make_dispatcher, open_api_store
from kvfuse.service.errors import APIError, model_failed, retry_after
from kvfuse.service.health import FAILED, OK, STARTING
from kvfuse.service.loop_lag import watch_loop_lag
from kvfuse.service.metrics import Metrics
from kvfuse.service.rag.corpus import Corpus
from kvfuse.service.rag.fidelity import FidelityLedger
from kvfuse.service.rag.ingest import IngestManager
from kvfuse.service.rag.parse_pool import ParsePool
from kvfuse.service.rag.query import QueryService
from kvfuse.service.rag.query_log import QueryLog

if TYPE_CHECKING:
    from kvfuse.store import KVStore

log = logging.getLogger(__name__)

_INDEX_RETRY_FIRST_S = 0.5  # first pause before retrying a document index (Redis) that is not up
_INDEX_RETRY_MAX_S = 10.0  # the pause doubles up to this


class ServiceState:
    """The API process's settings, dispatcher, metrics, ingestion jobs, query pipeline and, once loaded,
    its corpus."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.started_at = time.time()
        self.metrics = Metrics()
        self.dispatcher = make_dispatcher(settings, self.metrics)  # local worker(s) or fleet (dispatch/)
        self.ingest = IngestManager(settings, self.metrics, self.dispatcher)
        # The quality contract: shadow-check verdicts from the workers, the ratio held for the target.
        self.fidelity = FidelityLedger(settings, self.metrics)
        self.dispatcher.shadow_sink = self.fidelity.record
        # Answered queries for `kvfuse calibrate --from-log`, when `fidelity.query_log` is on (rag/query_log.py).
        self.query_log = QueryLog(settings)
        # Uploaded files are parsed in processes of their own, within the upload limits (rag/parse_pool.py).
        self.parsers = ParsePool(settings.server, self.metrics)
        self.queries = QueryService(settings, self.metrics, self.dispatcher, self.ingest, self.fidelity,
                                    self.query_log)
        self.corpus: Corpus | None = None  # once the store is open; its parts load after it
        self.startup_error: str | None = None
        self.waiting_for: str | None = None  # what startup is waiting for (a Redis not up yet)
        self.ready_since: float | None = None  # when model, store, index and embedder were first all up
        self._stopping = threading.Event()
        self._loader: asyncio.Task | None = None
        self._watch_model: asyncio.Task | None = None
        self._watch_lag: asyncio.Task | None = None
        self._components = asyncio.Event()

    # -- lifecycle -----------------------------------------------------------------------------------------
    async def start(self) -> None:
        # The worker starts first: loading the LLM is the slowest part and runs in its own process.
        await self.dispatcher.start()
        self.parsers.start()
        self._loader = asyncio.create_task(self._load(), name="kvfuse-load")
        self._watch_lag = asyncio.create_task(watch_loop_lag(self.metrics.loop_lag), name="kvfuse-loop-lag")

    async def _load(self) -> None:
        try:
            await asyncio.to_thread(self._load_components)
            self.ingest.recover()
            self.ingest.start()
            self._components.set()
            self._watch_model = asyncio.create_task(self._on_model(), name="kvfuse-model-check")
            self.refresh_document_gauge()
            log.info("store, index and embedder ready")
        except Exception as err:  # noqa: BLE001 - surfaced by /health, /ready and every request
            self.startup_error = f"{type(err).__name__}: {err}"
            log.exception("service failed to start: %s", self.startup_error)

    async def _on_model(self) -> None:
        """Once the worker reports its model: record its fingerprint in the store (what `kvfuse store
        check` compares blob headers with) and rebuild the documents built for another model."""
        while not await self.dispatcher.wait_ready(self.settings.server.worker_start_timeout_s):
            if self.dispatcher.failed:
                return  # the supervisor gave up and logged why: health() says failed
        self.ready_since = time.time()
        log.info("kvfuse is ready: model, store, index and embedder are up (%.1f s after start)",
                 self.ready_since - self.started_at)
        fp = self.dispatcher.info["fingerprint"]
        self.fidelity.attach_model(fp)
        try:
            await asyncio.to_thread(self.corpus.store.set_model_fingerprint, fp)
            stale = await asyncio.to_thread(self.ingest.stale_documents, fp)
            n = sum(self.ingest.resubmit(doc_id, why) is not None for doc_id, why in stale)
            if n:
                log.warning("%d documents have KV of another model or lost KV: rebuilding them", n)
        except Exception:  # noqa: BLE001 - queries still rebuild stale KV one chunk at a time
            log.exception("could not check the stored KV against the model")

    def _load_components(self) -> None:
        s = self.settings
        # The hot tier of decoded KV lives in the worker, which reads KV; here it would only waste RAM.
        api_settings = s.model_copy(update={"store": s.store.model_copy(update={"hot_tier_mb": 0})})
        self.corpus = Corpus(s, self._open_store(api_settings))
        self.corpus.load()
        self.ingest.attach(self.corpus)
        self.queries.attach(self.corpus)

    def _open_store(self, settings: Settings) -> KVStore:
        """Open the store, waiting for its index: a Redis that is not up yet is retried with a growing
        pause (`/ready` says what it waits for), so the service becomes ready when Redis comes."""
        from kvfuse.store import IndexUnavailableError
        from kvfuse.store.redis_access import RedisAccessDenied

        pause, attempt = _INDEX_RETRY_FIRST_S, 0
        while True:
            try:
                store = open_api_store(settings)
                self.waiting_for = None
                return store
            except IndexUnavailableError as err:
                attempt += 1
                denied = f" ({err})" if isinstance(err, RedisAccessDenied) else ""  # a setting to fix: say which
                self.waiting_for = f"the document index (Redis): attempt {attempt} failed{denied}, next in {pause:g} s"
                log.warning("waiting for %s: %s", self.waiting_for, err)
                if self._stopping.wait(pause):
                    raise RuntimeError("the service stopped while waiting for the document index") from None
                pause = min(pause * 2, _INDEX_RETRY_MAX_S)

    async def stop(self) -> None:
        self._stopping.set()
        await self.ingest.stop()
        for task in (self._loader, self._watch_model, self._watch_lag):
            if task is not None:
                task.cancel()
        await self.dispatcher.stop()
        await self.parsers.close()
        await asyncio.to_thread(self.query_log.close)
        if self.corpus is not None:
            await asyncio.to_thread(self.corpus.close)

    # -- readiness -----------------------------------------------------------------------------------------
    def readiness(self, document_index: bool = True) -> dict[str, bool]:
        """Which parts are up; `document_index` is whether the store's index answers now (Redis). `index`
        covers both retrieval indexes (vector and keyword)."""
        c = self.corpus
        return {"store": c is not None,
                "index": c is not None and c.index is not None and c.keyword is not None and self._components.is_set(),
                "embedder": c is not None and c.embedder is not None, "model": self.dispatcher.ready,
                "document_index": c is not None and document_index}

    async def document_index_available(self) -> bool:
        """Whether the store's document index (Redis, when configured) answers now."""
        return self.corpus is not None and await self.corpus.document_index_available()

    def health(self) -> tuple[str, str | None]:
        """(state, reason) as health.py defines them: failed for good, ok once ready, else starting."""
        failure = self.startup_error or self.dispatcher.failed
        if failure:
            return FAILED, failure
        if self.ready_since is not None:
            return OK, None
        return STARTING, self.not_ready_reason(self.readiness(document_index=self.corpus is not None))

    def not_ready_reason(self, parts: dict[str, bool]) -> str:
        """Why the service is not ready, for a valid key (it may name hosts, ports and paths)."""
        missing = ", ".join(k for k, ok in parts.items() if not ok)
        index_error = self.corpus.index_error if self.corpus is not None else None
        return (self.startup_error or self.dispatcher.failed or self.dispatcher.last_error
                or (f"the document index: {index_error}" if index_error else None)
                or (f"waiting for {self.waiting_for}" if self.waiting_for else f"waiting for: {missing}"))

    def require_components(self) -> None:
        """Raise 503 until store, index and embedder are loaded."""
        if self.startup_error:
            raise APIError(503, f"the service failed to start: {self.startup_error}", code="startup_failed")
        if not self._components.is_set():
            raise APIError(503, "the service is starting", code="not_ready",
                           headers=retry_after(self.settings))

    def require_model(self) -> None:
        """Raise 503 `model_failed` once the model can never serve (the reason /health gives): what needs
        the model (queries, chat completions, ingestion) says so before looking at the corpus."""
        if self.dispatcher.failed:
            raise model_failed(self.dispatcher.failed)

    def refresh_document_gauge(self) -> None:
        if self.corpus is not None:
            self.corpus.refresh_gauges(self.metrics)
