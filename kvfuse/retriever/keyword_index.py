"""The keyword index: BM25 (bm25s) over the same chunks as the vector index, document by document.

It holds each chunk's terms, not its text (the store has the text): chunk i of a document is the same
chunk i the vector index and the KV store know. Documents go in and out as in the vector index (`add`
replaces, `remove`), with `check` / `rebuild` for drift against the store. What sits where: the segments
(bm25s base, fresh rows, dead rows, the merge) in `keyword_segments`, the files in `keyword_files`. Which
documents a search may return is decided by the caller (the vector index owns metadata and collections:
`VectorIndex.select`), so filters mean the same in every retrieval mode.

Thread-safe: one lock guards the state; a merge builds the new base from a snapshot outside the lock (the
caller's thread: an ingestion), so searches keep answering from the old segments meanwhile, then swaps
it in with whatever changed during the build.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from kvfuse.config import RetrieverSettings
from kvfuse.retriever import keyword_files
from kvfuse.retriever import keyword_segments as seg
from kvfuse.retriever.results import DriftReport, Hit, drift

log = logging.getLogger(__name__)


class KeywordIndex:
    def __init__(self, directory: Path, settings: RetrieverSettings) -> None:
        self.directory = Path(directory)
        self.settings = settings
        self._lock = threading.RLock()
        self._merging = threading.Lock()
        self._state = seg.KeywordState()
        self._generation = 0
        self._dirty = False

    # -- lifecycle -------------------------------------------------------------------------------

    @classmethod
    def open(cls, directory: Path, settings: RetrieverSettings) -> KeywordIndex:
        """Load the saved index under `directory`, or start an empty one if none was saved. Raises
        IndexLoadError for a torn or corrupt pair of files or another analyzer (rebuild from text)."""
        self = cls(directory, settings)
        if keyword_files.is_saved(self.directory):
            saved = keyword_files.load_keywords(self.directory)
            self._state, self._generation = saved.state, saved.generation
            if saved.params != self._params:
                log.info("rebuilding the keyword index's base with k1, b = %s (saved with %s)", self._params,
                         saved.params)
                self.merge()
        return self

    @property
    def _params(self) -> tuple[float, float]:
        return (self.settings.bm25_k1, self.settings.bm25_b)

    def save(self) -> None:
        """Persist atomically; a no-op when nothing changed since the last save."""
        with self._lock:
            if not self._dirty and keyword_files.is_saved(self.directory):
                return
            self._generation = keyword_files.save_keywords(self.directory, self._state, k1=self._params[0],
                                                           b=self._params[1], generation=self._generation)
            self._dirty = False

    # -- documents --------------------------------------------------------------------------------

    def add(self, doc_id: str, texts: list[str]) -> None:
        """Index a document's chunk texts (item i = chunk i); re-adding a document replaces it."""
        if not texts:
            raise ValueError(f"document {doc_id!r} has no chunks")
        chunks = [seg.analyze(t) for t in texts]
        with self._lock:
            seg.add_rows(self._state, doc_id, chunks)
            self._dirty = True
        self._merge_if_due()

    def remove(self, doc_id: str) -> int:
        """Remove a document's chunks; returns how many (0 if it was not indexed)."""
        with self._lock:
            n = seg.remove_rows(self._state, doc_id)
            self._dirty = self._dirty or n > 0
        if n:
            self._merge_if_due()
        return n

    def rebuild(self, docs: Iterable[tuple[str, list[str]]]) -> int:
        """Replace the whole content with `docs` ((doc_id, chunk texts) each); returns documents. Built
        aside and swapped in at the end; an add() made meanwhile is lost, so rebuild before ingestion
        starts. Call save() to persist it."""
        state = seg.KeywordState()
        for doc_id, texts in docs:
            if doc_id in state.docs:
                raise ValueError(f"document {doc_id!r} appears twice in the rebuild")
            seg.add_rows(state, doc_id, [seg.analyze(t) for t in texts])
        state = seg.merged(state, *self._params)
        with self._lock:
            self._state = state
            self._dirty = True
        return len(state.docs)

    def merge(self) -> None:
        """Fold fresh rows into the base and drop dead ones now (normally done when due, see
        `keyword_segments`). Changes made while the base builds are carried over."""
        with self._merging:
            with self._lock:  # the arrays are replaced on change, never written: a snapshot is references
                st = self._state
                snapshot = seg.KeywordState(terms=st.terms[:], tokens=st.tokens, offsets=st.offsets,
                                            alive=st.alive, docs=dict(st.docs))
            new = seg.merged(snapshot, *self._params)
            snap_docs = snapshot.docs
            with self._lock:
                current = self._state
                for doc_id, rr in current.docs.items():
                    if snap_docs.get(doc_id) != rr:  # added or replaced during the build
                        o = current.offsets
                        seg.add_rows(new, doc_id, [[current.terms[t] for t in current.tokens[o[r] : o[r + 1]]]
                                                   for r in range(rr.start, rr.start + rr.count)])
                for doc_id in [d for d in new.docs if d not in current.docs]:  # removed during the build
                    seg.remove_rows(new, doc_id)
                self._state = new
                self._dirty = True

    def _merge_if_due(self) -> None:
        s = self.settings
        with self._lock:
            due = seg.needs_merge(self._state, s.keyword_merge_ratio, s.keyword_merge_min_chunks)
        if due and not self._merging.locked():
            self.merge()

    def check(self, expected: dict[str, int]) -> DriftReport:
        """Compare with the store's view {document_id: number of chunks}."""
        with self._lock:
            have = {d: rr.count for d, rr in self._state.docs.items()}
        return drift("keyword index", have, expected)

    def document_ids(self) -> set[str]:
        with self._lock:
            return set(self._state.docs)

    def chunk_count(self, doc_id: str) -> int:
        with self._lock:
            rr = self._state.docs.get(doc_id)
            return rr.count if rr else 0

    def segments(self) -> dict[str, int]:
        """Rows in the base and fresh segments, dead rows among them, and vocabulary size."""
        with self._lock:
            st = self._state
            return {"base": st.base_rows, "fresh": st.fresh, "dead": st.dead, "terms": len(st.terms)}

    def __len__(self) -> int:
        """Live chunks (removed ones excluded)."""
        with self._lock:
            return self._state.live

    # -- search -----------------------------------------------------------------------------------

    @staticmethod
    def terms(query: str) -> list[str]:
        """The distinct terms a query searches for, in order (empty: nothing to match, e.g. only
        stopwords or punctuation)."""
        return list(dict.fromkeys(seg.analyze(query)))

    def search(self, query: str, top_k: int, *, document_ids: list[str] | None = None) -> list[Hit]:
        """The top_k chunks by BM25, best first, among `document_ids` (None: all; empty: none). Only
        chunks sharing a term with the query are returned, so there may be fewer than top_k."""
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        terms = self.terms(query)
        with self._lock:
            st = self._state
            ids = [st.vocab[t] for t in terms if t in st.vocab]
            if not ids or st.live == 0:
                return []
            values = seg.scores(st, ids, *self._params)
            mask = st.alive
            if document_ids is not None:
                mask = np.zeros(st.rows, dtype=bool)
                for d in document_ids:
                    rr = st.docs.get(d)
                    if rr is not None:
                        mask[rr.start : rr.start + rr.count] = True
            rows = seg.top_rows(values, mask, top_k)
            return seg.hits(st, rows, values)
