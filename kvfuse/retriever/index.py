"""The vector index of chunk embeddings: documents in, chunk hits out, with filters and drift checks.

Ids: every chunk vector gets an int64 id from a counter that only grows; a document's chunks hold the
consecutive range [start, start + count), so id -> (document_id, chunk_index = id - start).

What sits where: the FAISS index and the calls made on it in `faiss_index`, removal from HNSW
(tombstones) and the rebuild that drops them in `compaction`, the files on disk (atomic save, verified
load) in `index_files`. This module holds the document-level API the service uses, behind one lock.
"""

from __future__ import annotations

import bisect
import copy
import json
import logging
import threading
from collections.abc import Iterable
from pathlib import Path

import faiss
import numpy as np

from kvfuse.config import DEFAULT_COLLECTION, RetrieverSettings
from kvfuse.retriever import index_files
from kvfuse.retriever.compaction import compacted, needs_compaction
from kvfuse.retriever.errors import FilterTypeError
from kvfuse.retriever.faiss_index import (
    DocRange,
    IndexState,
    add_vectors,
    id_ranges,
    new_faiss,
    omp_threads,
    stored_vectors,
)
from kvfuse.retriever.filters import Filter, kind
from kvfuse.retriever.filters import parse as parse_filter
from kvfuse.retriever.results import DriftReport, Hit, drift

log = logging.getLogger(__name__)


class VectorIndex:
    """Thread-safe: the service searches from a thread pool while ingestion adds; one lock guards all."""

    def __init__(self, directory: Path, dim: int, settings: RetrieverSettings, *, embedder_fingerprint: str = ""):
        self.directory = Path(directory)
        self.dim = dim
        self.embedder_fingerprint = embedder_fingerprint  # Embedder.fingerprint; "" = not checked
        self.settings = settings
        self.index_type = settings.index_type
        self._lock = threading.RLock()
        self._state = IndexState(new_faiss(dim, settings), {})
        self._starts: list[int] = []  # sorted range starts, for id -> document lookups
        self._start_docs: list[str] = []
        self._generation = 0
        self._dirty = False
        self._collections: dict[str, int] | None = None  # documents per collection, counted after a change

    # -- lifecycle -------------------------------------------------------------------------------

    @classmethod
    def open(
        cls, directory: Path, dim: int, settings: RetrieverSettings, *, embedder_fingerprint: str = ""
    ) -> VectorIndex:
        """Load the saved index under `directory`, or start an empty one if none was saved.

        A saved index of the other type is converted to the configured one (from its own vectors).
        Raises IndexLoadError for a torn or corrupt pair of files, another dimension, or (when both
        sides know it) vectors of another embedding model."""
        self = cls(directory, dim, settings, embedder_fingerprint=embedder_fingerprint)
        if index_files.is_saved(self.directory):
            saved = index_files.load_index(self.directory, dim=dim, embedder_fingerprint=embedder_fingerprint)
            self._generation = saved.generation
            self._install(saved.state)
            if saved.index_type != self.index_type:
                log.info("converting the saved %s index to %s (%d vectors)", saved.index_type, self.index_type,
                         saved.state.live)
                self._compact()
        return self

    def save(self) -> None:
        """Persist atomically (see index_files); a no-op when nothing changed since the last save."""
        with self._lock:
            if not self._dirty and index_files.is_saved(self.directory):
                return
            self._generation = index_files.save_index(
                self.directory, self._state, dim=self.dim, index_type=self.index_type,
                embedder_fingerprint=self.embedder_fingerprint, generation=self._generation,
            )
            self._dirty = False

    # -- documents --------------------------------------------------------------------------------

    def add(self, doc_id: str, vectors: np.ndarray, metadata: dict | None = None,
            collection: str = DEFAULT_COLLECTION) -> None:
        """Index a document's chunk vectors (row i = chunk i) in `collection`; re-adding a document
        replaces it (and moves it, given another collection).

        Vectors are expected L2-normalized (inner product = cosine). Metadata must be JSON-serializable:
        it is saved in the sidecar and matched by `filters`."""
        vecs = self._check_vectors(doc_id, vectors)
        meta = _json_copy(metadata or {}, doc_id)
        with self._lock:
            if doc_id in self._state.docs:
                self._remove_locked(doc_id)
            self._add_locked(self._state, doc_id, vecs, meta, collection)
            self._collections = None
            self._index_starts(doc_id, self._state.docs[doc_id].start)
            self._dirty = True

    def remove(self, doc_id: str) -> int:
        """Remove a document's vectors; returns how many (0 if it was not indexed)."""
        with self._lock:
            n = self._remove_locked(doc_id)
            if n:
                self._dirty = True
            return n

    def rebuild(self, docs: Iterable[tuple]) -> int:
        """Replace the whole content with `docs` ((doc_id, vectors, metadata[, collection]) each); returns
        documents.

        The new index is built aside (the iterable may embed texts as it goes) and swapped in at the end,
        so searches keep answering from the old one meanwhile; an add() made during the rebuild is lost
        with the old content, so rebuild before ingestion starts. Call save() to persist it."""
        state = IndexState(new_faiss(self.dim, self.settings), {})
        blocks: list[np.ndarray] = []
        for doc_id, vectors, metadata, *collection in docs:
            if doc_id in state.docs:
                raise ValueError(f"document {doc_id!r} appears twice in the rebuild")
            vecs = self._check_vectors(doc_id, vectors)
            state.docs[doc_id] = DocRange(state.next_id, len(vecs), _json_copy(metadata or {}, doc_id),
                                          collection[0] if collection else DEFAULT_COLLECTION)
            state.next_id += len(vecs)
            blocks.append(vecs)
        if blocks:  # one add, large enough to use every OpenMP thread
            add_vectors(state.index, np.concatenate(blocks), np.arange(state.next_id, dtype=np.int64))
        with self._lock:
            self._install(state)
            self._dirty = True
        return len(state.docs)

    def check(self, expected: dict[str, int]) -> DriftReport:
        """Compare with the store's view {document_id: number of chunks}."""
        with self._lock:
            have = {d: r.count for d, r in self._state.docs.items()}
        return drift("vector index", have, expected)

    def document_ids(self) -> set[str]:
        with self._lock:
            return set(self._state.docs)

    def chunk_count(self, doc_id: str) -> int:
        with self._lock:
            doc = self._state.docs.get(doc_id)
            return doc.count if doc else 0

    def metadata(self, doc_id: str) -> dict | None:
        with self._lock:
            doc = self._state.docs.get(doc_id)
            return copy.deepcopy(doc.metadata) if doc else None

    def collections(self) -> dict[str, int]:
        """{collection: indexed documents}, by name (counted once after each change, not per query)."""
        with self._lock:
            if self._collections is None:
                counts: dict[str, int] = {}
                for doc in self._state.docs.values():
                    counts[doc.collection] = counts.get(doc.collection, 0) + 1
                self._collections = dict(sorted(counts.items()))
            return dict(self._collections)

    def select(self, *, document_ids: list[str] | None = None, filters: dict | None = None,
               collections: list[str] | None = None) -> list[str]:
        """The indexed documents passing every restriction given (None: no restriction), in index order
        (or in `document_ids`' order). The selection other indexes over the same documents search in.
        `filters` follow retriever/filters.py (raises FilterSyntaxError for one that is not a filter).
        Raises FilterTypeError for a filter value of a JSON type its field never has in these collections."""
        flt = parse_filter(filters) if filters else None
        with self._lock:
            docs = self._state.docs
            names = list(self._names(document_ids, collections))
            if flt is None:
                return names
            self._check_filter_types(names, flt)
            return [d for d in names if flt.matches(docs[d].metadata)]

    def __len__(self) -> int:
        """Live vectors (removed ones excluded)."""
        with self._lock:
            return self._state.live

    # -- search -----------------------------------------------------------------------------------

    def search(
        self,
        query: np.ndarray,
        top_k: int,
        *,
        document_ids: list[str] | None = None,
        filters: dict | None = None,
        collections: list[str] | None = None,
    ) -> list[Hit]:
        """The top_k chunks by inner product, best first, among documents passing every restriction.

        `document_ids`: only these documents (an empty list matches none). `filters`: every key equals
        the document's metadata (retriever/filters.py; see `select`). `collections`: only
        documents of these. Restricted searches still return top_k hits when that many chunks pass:
        FAISS scans only the allowed ids (IDSelectorBatch)."""
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        q = np.ascontiguousarray(np.asarray(query, dtype=np.float32).reshape(1, -1))
        if q.shape[1] != self.dim:
            raise ValueError(f"query has dimension {q.shape[1]}, the index holds {self.dim}")
        with self._lock:
            state = self._state
            allowed: np.ndarray | None = None
            if document_ids is not None or filters or collections is not None:
                chosen = [state.docs[d] for d in self.select(document_ids=document_ids, filters=filters,
                                                             collections=collections)]
                if not chosen:
                    return []
                allowed = id_ranges((r.start, r.count) for r in chosen)
                n_allowed = len(allowed)
            else:
                n_allowed = state.live
            k = min(top_k, n_allowed)
            if k == 0:
                return []
            scores, ids = self._faiss_search(q, k, allowed)
            if len(ids) < k:
                # HNSW under a narrow filter can end its graph walk before finding k allowed ids.
                scores, ids = self._exact_search(q, k, allowed)
            return [self._hit(int(i), float(s)) for s, i in zip(scores, ids, strict=True)]

    def _names(self, document_ids: list[str] | None, collections: list[str] | None) -> Iterable[str]:
        docs = self._state.docs
        names: Iterable[str] = docs.keys() if document_ids is None else dict.fromkeys(
            d for d in document_ids if d in docs)
        if collections is not None:
            wanted = set(collections)
            names = [d for d in names if docs[d].collection in wanted]
        return names

    def _check_filter_types(self, names: Iterable[str], flt: Filter) -> None:
        conditions = list(flt.conditions())
        kinds: dict[str, set[str]] = {c.field: set() for c in conditions}
        for d in names:
            meta = self._state.docs[d].metadata
            for k in kinds:
                if k in meta:
                    kinds[k].add(kind(meta[k]))
        for c in conditions:
            wanted = c.kinds()
            if kinds[c.field] and not wanted & kinds[c.field]:
                op = "" if c.op == "$eq" else f" ({c.op})"
                raise FilterTypeError(c.field, f"filter {c.field!r}{op} is a {' or '.join(sorted(wanted))}, "
                                      f"but the documents searched store {c.field!r} as "
                                      f"{' or '.join(sorted(kinds[c.field]))}: it could never match")

    def _faiss_search(self, q: np.ndarray, k: int, allowed: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        state = self._state
        sel = None
        if allowed is not None:
            sel = faiss.IDSelectorBatch(allowed)
        elif state.tombstones:
            batch = faiss.IDSelectorBatch(id_ranges(state.tombstones))
            sel = faiss.IDSelectorNot(batch)
        if self.index_type == "hnsw":
            params = faiss.SearchParametersHNSW(efSearch=max(self.settings.hnsw_ef_search, k))
            if sel is not None:
                params.sel = sel
        else:
            params = faiss.SearchParameters(sel=sel) if sel is not None else None
        with omp_threads(1):
            scores, ids = state.index.search(q, k, params=params)
        keep = ids[0] >= 0
        return scores[0][keep], ids[0][keep]

    def _exact_search(self, q: np.ndarray, k: int, allowed: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        ids, xb = stored_vectors(self._state.index, self.dim)
        if allowed is None:
            allowed = id_ranges((r.start, r.count) for r in self._state.docs.values())
        rows = np.flatnonzero(np.isin(ids, allowed))
        scores = xb[rows] @ q[0]
        top = np.argsort(-scores, kind="stable")[:k]
        return scores[top], ids[rows[top]]

    def _hit(self, vid: int, score: float) -> Hit:
        pos = bisect.bisect_right(self._starts, vid) - 1
        doc_id = self._start_docs[pos]
        return Hit(doc_id, vid - self._state.docs[doc_id].start, score)

    # -- internals ----------------------------------------------------------------------------------

    def _check_vectors(self, doc_id: str, vectors: np.ndarray) -> np.ndarray:
        vecs = np.ascontiguousarray(np.asarray(vectors, dtype=np.float32))
        if vecs.ndim != 2 or vecs.shape[1] != self.dim:
            raise ValueError(f"vectors must have shape [n, {self.dim}], got {list(vecs.shape)}")
        if len(vecs) == 0:
            raise ValueError(f"document {doc_id!r} has no vectors")
        return vecs

    @staticmethod
    def _add_locked(state: IndexState, doc_id: str, vecs: np.ndarray, meta: dict, collection: str) -> None:
        start = state.next_id
        add_vectors(state.index, vecs, np.arange(start, start + len(vecs), dtype=np.int64))
        state.docs[doc_id] = DocRange(start, len(vecs), meta, collection)
        state.next_id = start + len(vecs)

    def _remove_locked(self, doc_id: str) -> int:
        state = self._state
        doc = state.docs.pop(doc_id, None)
        if doc is None:
            return 0
        self._collections = None
        pos = bisect.bisect_left(self._starts, doc.start)
        del self._starts[pos], self._start_docs[pos]
        if self.index_type == "hnsw":
            state.tombstones.append((doc.start, doc.count))
            if needs_compaction(state, self.settings):
                self._compact()
        else:
            state.index.remove_ids(faiss.IDSelectorRange(doc.start, doc.start + doc.count))
        return doc.count

    def _index_starts(self, doc_id: str, start: int) -> None:
        # Ids only grow, so a new document's range sorts last; bisect keeps this right after a rebuild too.
        pos = bisect.bisect_left(self._starts, start)
        self._starts.insert(pos, start)
        self._start_docs.insert(pos, doc_id)

    def _install(self, state: IndexState) -> None:
        self._state = state
        self._collections = None
        pairs = sorted((r.start, d) for d, r in state.docs.items())
        self._starts = [s for s, _ in pairs]
        self._start_docs = [d for _, d in pairs]

    def _compact(self) -> None:
        self._state = compacted(self._state, self.dim, self.settings)
        self._dirty = True


def _json_copy(metadata: dict, doc_id: str) -> dict:
    """The metadata as it will read back from the sidecar (tuples become lists, keys strings)."""
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata of {doc_id!r} must be a dict, got {type(metadata).__name__}")
    try:
        return json.loads(json.dumps(metadata))
    except (TypeError, ValueError) as err:
        raise ValueError(f"metadata of {doc_id!r} is not JSON-serializable: {err}") from err
