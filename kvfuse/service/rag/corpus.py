"""`Corpus`: the API process's documents. The store's catalog and texts, the vector and keyword indexes
kept in step with it, and the embedder and chunker that fill them.

Ingestion, queries and the document routes all work through one `Corpus`; none of them reaches for the
others' parts. Index writes are saved at once: the indexes on disk must match the store after any
commit, and the startup check (`reconcile`) repairs what a crash between two writes left behind.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from kvfuse.config import Settings
from kvfuse.service.errors import APIError

if TYPE_CHECKING:
    import numpy as np

    from kvfuse.retriever import Chunker, Embedder, VectorIndex
    from kvfuse.retriever.keyword_index import KeywordIndex
    from kvfuse.service.metrics import Metrics
    from kvfuse.store import DocumentRecord, KVStore

log = logging.getLogger(__name__)

_DOC_TOKEN_CACHE = 256  # documents whose chunk token ids are kept (so a query does not re-tokenize them)


class Corpus:
    """The store, then (once `load` ran) the chunker, embedder and both retrieval indexes."""

    def __init__(self, settings: Settings, store: KVStore) -> None:
        self.settings = settings
        self.store = store
        self.chunker: Chunker | None = None
        self.embedder: Embedder | None = None
        self.index: VectorIndex | None = None
        self.keyword: KeywordIndex | None = None
        self.index_error: str | None = None  # why the document index last failed to answer (for /ready)
        self._doc_tokens: OrderedDict[tuple[str, str], list[list[int]]] = OrderedDict()
        self._chunk_texts: OrderedDict[tuple[str, str], list[str]] = OrderedDict()

    # -- loading -------------------------------------------------------------------------------------------
    def load(self) -> None:
        """Load the tokenizer-only chunker, the embedder and the indexes (rebuilt from the stored documents
        if unusable), then reconcile them with the store. Slow: call it in a thread."""
        from kvfuse.model_files import resolve_embedder, resolve_llm
        from kvfuse.retriever import Chunker, Embedder

        s = self.settings
        self.chunker = Chunker.from_pretrained(resolve_llm(s.model.llm, s.models_dir), s.retriever.chunk_tokens)
        self.embedder = Embedder(resolve_embedder(s.model.embedder), device="cpu",
                                 batch_size=s.model.embed_batch_size)
        self.index = self._open_index()
        self.keyword = self._open_keyword_index()
        self.reconcile()

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

    def reconcile(self) -> None:
        """After a crash: the indexes hold exactly the ready documents. (Unfinished jobs resume from the
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

    def close(self) -> None:
        for index in (self.index, self.keyword):
            if index is not None:
                index.save()
        self.store.close()

    # -- reading -------------------------------------------------------------------------------------------
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
            yield doc_id, self.embedder.embed(texts, background=True), rec.metadata, rec.collection

    def prompt_name(self, rec: Any) -> str:
        """The document's name in the labelled prompt: its `title` metadata, else its id; "" when the
        prompt is plain (`model.prompt_layout`)."""
        if self.settings.model.prompt_layout == "plain":
            return ""
        doc_id = getattr(rec, "document_id", None) or rec.id  # an ingestion job's record, or the document's
        return str(rec.metadata.get("title") or doc_id)

    def prompt_blocks(self, chunk_ids: list[list[int]], name: str) -> list[list[int]]:
        """Chunks' token ids as cached and fused under `model.prompt_layout` (kvfuse/fusion/prompt.py):
        what ingestion precomputes and keys, and what a query fuses."""
        from kvfuse.fusion.prompt import block_ids

        layout = self.settings.model.prompt_layout
        return [block_ids(self.chunker.encode, ids, name, layout) for ids in chunk_ids]

    def prompt_chunk_ids(self, rec: Any) -> list[list[int]]:
        """A ready document's chunks as fused (`prompt_blocks` of `chunk_token_ids`)."""
        return self.prompt_blocks(self.chunk_token_ids(rec), self.prompt_name(rec))

    def chunk_token_ids(self, rec: Any) -> list[list[int]]:
        """A ready document's chunk token ids: its tokens split by the chunk sizes stored at ingest (so
        chunking settings may change later without invalidating stored KV)."""
        def split(text: str) -> list[list[int]]:
            ids = self.chunker.encode(text)
            _check_tokenizes_as_stored(rec, len(ids))
            out, pos = [], 0
            for n in rec.chunk_tokens:
                out.append(list(ids[pos : pos + n]))
                pos += n
            return out

        return self._per_version(self._doc_tokens, rec, split)

    def chunk_texts(self, rec: Any) -> list[str]:
        """A ready document's chunk texts: the spans of its stored text that its chunks' tokens cover (cut at
        the first character of the next chunk's first token, so the texts tile the document). What
        citations, /v1/search and the chunk listing show; the tokens stay what the model reads."""
        def spans(text: str) -> list[str]:
            offsets = self.chunker.token_starts(text)
            _check_tokenizes_as_stored(rec, len(offsets))
            starts, pos = [], 0
            for n in rec.chunk_tokens:
                starts.append(0 if pos == 0 else offsets[pos])
                pos += n
            return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]

        return self._per_version(self._chunk_texts, rec, spans)

    def _per_version(self, memo: OrderedDict, rec: Any, compute: Callable[[str], Any]) -> Any:
        """`compute(the document's stored text)`, kept per document version in `memo` (least recently used
        dropped beyond the cache's size)."""
        key = (rec.id, rec.content_hash)
        if key in memo:
            memo.move_to_end(key)
            return memo[key]
        text = self.store.get_text(rec.id)
        if text is None:
            raise APIError(404, f"document {rec.id!r} has no stored text", code="document_not_found")
        memo[key] = value = compute(text)
        while len(memo) > _DOC_TOKEN_CACHE:
            memo.popitem(last=False)
        return value

    async def document_index_available(self) -> bool:
        """Whether the store's document index (Redis, when configured) answers now."""
        try:
            available = await asyncio.to_thread(self.store.catalog.index_available)
            self.index_error = None
            return available
        except Exception as err:  # noqa: BLE001 - any failure means not available
            self.index_error = str(err)  # a refused password reads here as what to fix
            return False

    def refresh_gauges(self, metrics: Metrics) -> None:
        try:
            stats = self.store.stats()
            metrics.documents.set(stats["documents"])
            metrics.kv_chunks.set(stats["chunks"])
            metrics.kv_bytes.set(stats["kv_bytes"])
        except Exception:  # noqa: BLE001 - a gauge must never fail a request
            log.debug("store stats unavailable", exc_info=True)

    # -- index writes (always saved) -------------------------------------------------------------------------
    def index_replace(self, doc_id: str, vectors: np.ndarray, texts: list[str], metadata: dict,
                      collection: str) -> None:
        """A document's new version in both retrieval indexes (vectors and chunk texts, row i = chunk i) in
        place of the old one, each saved once. A crash between the two saves leaves the keyword index
        behind the store: the startup check (`reconcile`) adds what it lacks from the stored text."""
        self.index.add(doc_id, vectors, metadata, collection)
        self.index.save()
        self.keyword.add(doc_id, texts)
        self.keyword.save()

    def index_remove(self, doc_id: str) -> None:
        if self.index.remove(doc_id):
            self.index.save()
        if self.keyword.remove(doc_id):
            self.keyword.save()


def _check_tokenizes_as_stored(rec: Any, tokens: int) -> None:
    if tokens != sum(rec.chunk_tokens):
        raise APIError(500, f"document {rec.id!r} no longer tokenizes as it did at ingestion: re-ingest it",
                       code="tokenizer_changed")
