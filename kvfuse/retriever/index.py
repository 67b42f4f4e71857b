"""The FAISS vector index of chunk embeddings, with document-level add/remove, filters and persistence.

Ids: every chunk vector gets an int64 id from a counter that only grows; a document's chunks hold the
consecutive range [start, start + count), so id -> (document_id, chunk_index = id - start).

Index types (`retriever.index_type`): `flat` is exact inner product (cosine on normalized vectors);
`hnsw` is approximate and scales to large corpora. Both sit in an `IndexIDMap2`. HNSW cannot delete, so
a removed document's ids become tombstones that searches exclude, and the index is rebuilt from its own
stored vectors once tombstones exceed `hnsw_compact_ratio` of it.

On disk (`directory`): `index-<generation>.faiss` and the sidecar `index.json` (id map, metadata,
tombstones, and the size + sha256 of the index file it belongs to). A save writes a new generation's
index file, then replaces the sidecar, each atomically (temp + fsync + rename): the sidecar's rename is
the commit, so a crash leaves the old pair or the new pair. `open` verifies the pair and raises
IndexLoadError when it does not match; the caller then rebuilds from the stored documents.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import hashlib
import json
import logging
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from kvfuse.config import RetrieverSettings
from kvfuse.retriever.errors import IndexLoadError
from kvfuse.retriever.files import atomic_write

log = logging.getLogger(__name__)

SIDECAR = "index.json"
FORMAT_VERSION = 1
# Adds smaller than this run on one OpenMP thread: a document's few chunks are too little work to share,
# and each parallel region waits at a barrier for every thread (measured on a busy 2-core machine: HNSW
# adds of 100 vectors 4.5x slower on 2 threads than on 1).
PARALLEL_ADD_MIN = 4096


@dataclass(frozen=True)
class Hit:
    document_id: str
    chunk_index: int
    score: float


@dataclass
class DriftReport:
    """Index vs. store: what a startup check found."""

    missing: list[str] = field(default_factory=list)  # in the store, not in the index
    extra: list[str] = field(default_factory=list)  # in the index, not in the store
    mismatched: dict[str, tuple[int, int]] = field(default_factory=dict)  # id -> (store chunks, indexed)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.extra or self.mismatched)

    def summary(self) -> str:
        if self.ok:
            return "index matches the store"
        return (
            f"index drift: {len(self.missing)} documents missing, {len(self.extra)} extra, "
            f"{len(self.mismatched)} with another chunk count"
        )


@dataclass
class _Doc:
    start: int
    count: int
    metadata: dict[str, Any]


@dataclass
class _State:
    """Everything a save writes; swapped as a whole by rebuild()."""

    index: Any  # faiss.IndexIDMap2
    docs: dict[str, _Doc]
    next_id: int = 0
    tombstones: list[tuple[int, int]] = field(default_factory=list)  # (start, count) ranges (hnsw)

    @property
    def dead(self) -> int:
        return sum(c for _, c in self.tombstones)


class VectorIndex:
    """Thread-safe: the service searches from a thread pool while ingestion adds; one lock guards all."""

    def __init__(self, directory: Path, dim: int, settings: RetrieverSettings, *, embedder_fingerprint: str = ""):
        self.directory = Path(directory)
        self.dim = dim
        self.embedder_fingerprint = embedder_fingerprint  # Embedder.fingerprint; "" = not checked
        self.settings = settings
        self.index_type = settings.index_type
        self._lock = threading.RLock()
        self._state = _State(self._new_faiss(), {})
        self._starts: list[int] = []  # sorted range starts, for id -> document lookups
        self._start_docs: list[str] = []
        self._generation = 0
        self._dirty = False

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
        if (self.directory / SIDECAR).exists():
            self._load()
        return self

    def save(self) -> None:
        """Persist atomically (see the module doc); a no-op when nothing changed since the last save."""
        with self._lock:
            if not self._dirty and (self.directory / SIDECAR).exists():
                return
            self.directory.mkdir(parents=True, exist_ok=True)
            # Past every generation on disk: a fresh index saved over a torn one never overwrites the
            # file the old sidecar still names before the new sidecar lands.
            on_disk = [_generation_of(p) for p in self.directory.glob("index-*.faiss")]
            generation = max([self._generation, *on_disk]) + 1
            name = f"index-{generation:08d}.faiss"
            blob = faiss.serialize_index(self._state.index)
            atomic_write(self.directory / name, blob)
            body = {
                "format": FORMAT_VERSION,
                "dim": self.dim,
                "embedder_fingerprint": self.embedder_fingerprint,
                "index_type": self.index_type,
                "generation": generation,
                "next_id": self._state.next_id,
                "ntotal": int(self._state.index.ntotal),
                "index_file": {"name": name, "bytes": int(blob.nbytes), "sha256": hashlib.sha256(blob).hexdigest()},
                "documents": {
                    d: {"start": r.start, "count": r.count, "metadata": r.metadata} for d, r in self._state.docs.items()
                },
                "tombstones": [list(t) for t in self._state.tombstones],
            }
            atomic_write(self.directory / SIDECAR, _seal(body))
            self._generation = generation
            self._dirty = False
            for old in self.directory.glob("index-*.faiss"):
                if old.name != name:
                    with contextlib.suppress(OSError):
                        old.unlink()

    def _load(self) -> None:
        sidecar = self.directory / SIDECAR
        body = _unseal(sidecar.read_bytes(), sidecar)
        try:
            if body["format"] != FORMAT_VERSION:
                raise IndexLoadError(f"{sidecar}: format {body['format']}, this version reads {FORMAT_VERSION}")
            if body["dim"] != self.dim:
                raise IndexLoadError(
                    f"{sidecar}: saved vectors have dimension {body['dim']}, the embedder gives {self.dim} "
                    "(the embedding model changed): rebuild the index"
                )
            saved_fp = body.get("embedder_fingerprint", "")
            if saved_fp and self.embedder_fingerprint and saved_fp != self.embedder_fingerprint:
                raise IndexLoadError(
                    f"{sidecar}: vectors come from another embedding model (fingerprint {saved_fp}, "
                    f"this one is {self.embedder_fingerprint}): rebuild the index"
                )
            meta = body["index_file"]
            path = self.directory / meta["name"]
            try:
                blob = path.read_bytes()
            except FileNotFoundError:
                raise IndexLoadError(f"{path} named by {sidecar} is missing: torn index files") from None
            if len(blob) != meta["bytes"] or hashlib.sha256(blob).hexdigest() != meta["sha256"]:
                raise IndexLoadError(f"{path} does not match the size/checksum recorded in {sidecar}")
            index = faiss.deserialize_index(np.frombuffer(blob, dtype=np.uint8))
            docs = {
                d: _Doc(int(r["start"]), int(r["count"]), dict(r["metadata"])) for d, r in body["documents"].items()
            }
            state = _State(index, docs, int(body["next_id"]), [(int(s), int(c)) for s, c in body["tombstones"]])
            live = sum(r.count for r in docs.values())
            if index.ntotal != body["ntotal"] or index.ntotal != live + state.dead or index.d != self.dim:
                raise IndexLoadError(
                    f"{sidecar}: counts disagree (index file {index.ntotal} vectors, sidecar {body['ntotal']}, "
                    f"{live} live + {state.dead} removed)"
                )
            self._generation = int(body["generation"])
        except (KeyError, TypeError, ValueError) as err:
            raise IndexLoadError(f"{sidecar}: malformed ({type(err).__name__}: {err})") from err
        self._install(state)
        if body["index_type"] != self.index_type:
            log.info("converting the saved %s index to %s (%d vectors)", body["index_type"], self.index_type, live)
            self._compact()

    # -- documents --------------------------------------------------------------------------------

    def add(self, doc_id: str, vectors: np.ndarray, metadata: dict | None = None) -> None:
        """Index a document's chunk vectors (row i = chunk i); re-adding a document replaces it.

        Vectors are expected L2-normalized (inner product = cosine). Metadata must be JSON-serializable:
        it is saved in the sidecar and matched by `filters`."""
        vecs = self._check_vectors(vectors)
        if len(vecs) == 0:
            raise ValueError(f"document {doc_id!r} has no vectors")
        meta = _json_copy(metadata or {}, doc_id)
        with self._lock:
            if doc_id in self._state.docs:
                self._remove_locked(doc_id)
            self._add_locked(self._state, doc_id, vecs, meta)
            self._index_starts(doc_id, self._state.docs[doc_id].start)
            self._dirty = True

    def remove(self, doc_id: str) -> int:
        """Remove a document's vectors; returns how many (0 if it was not indexed)."""
        with self._lock:
            n = self._remove_locked(doc_id)
            if n:
                self._dirty = True
            return n

    def rebuild(self, docs: Iterable[tuple[str, np.ndarray, dict | None]]) -> int:
        """Replace the whole content with `docs` ((doc_id, vectors, metadata) each); returns documents.

        The new index is built aside (the iterable may embed texts as it goes) and swapped in at the end,
        so searches keep answering from the old one meanwhile; an add() made during the rebuild is lost
        with the old content, so rebuild before ingestion starts. Call save() to persist it."""
        state = _State(self._new_faiss(), {})
        blocks: list[np.ndarray] = []
        for doc_id, vectors, metadata in docs:
            if doc_id in state.docs:
                raise ValueError(f"document {doc_id!r} appears twice in the rebuild")
            vecs = self._check_vectors(vectors)
            if len(vecs) == 0:
                raise ValueError(f"document {doc_id!r} has no vectors")
            state.docs[doc_id] = _Doc(state.next_id, len(vecs), _json_copy(metadata or {}, doc_id))
            state.next_id += len(vecs)
            blocks.append(vecs)
        if blocks:  # one add, large enough to use every OpenMP thread
            _add_vectors(state.index, np.concatenate(blocks), np.arange(state.next_id, dtype=np.int64))
        with self._lock:
            self._install(state)
            self._dirty = True
        return len(state.docs)

    def check(self, expected: dict[str, int]) -> DriftReport:
        """Compare with the store's view {document_id: number of chunks}."""
        with self._lock:
            have = {d: r.count for d, r in self._state.docs.items()}
        report = DriftReport(
            missing=sorted(set(expected) - set(have)),
            extra=sorted(set(have) - set(expected)),
            mismatched={d: (n, have[d]) for d, n in sorted(expected.items()) if d in have and have[d] != n},
        )
        if not report.ok:
            log.warning("%s", report.summary())
        return report

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

    def __len__(self) -> int:
        """Live vectors (removed ones excluded)."""
        with self._lock:
            return int(self._state.index.ntotal) - self._state.dead

    # -- search -----------------------------------------------------------------------------------

    def search(
        self,
        query: np.ndarray,
        top_k: int,
        *,
        document_ids: list[str] | None = None,
        filters: dict | None = None,
    ) -> list[Hit]:
        """The top_k chunks by inner product, best first, among documents passing both restrictions.

        `document_ids`: only these documents (an empty list matches none). `filters`: every key equals
        the document's metadata value. Restricted searches still return top_k hits when that many
        chunks pass: FAISS scans only the allowed ids (IDSelectorBatch)."""
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        q = np.ascontiguousarray(np.asarray(query, dtype=np.float32).reshape(1, -1))
        if q.shape[1] != self.dim:
            raise ValueError(f"query has dimension {q.shape[1]}, the index holds {self.dim}")
        with self._lock:
            state = self._state
            allowed: np.ndarray | None = None
            if document_ids is not None or filters:
                chosen = self._select(document_ids, filters)
                if not chosen:
                    return []
                allowed = np.concatenate([np.arange(r.start, r.start + r.count, dtype=np.int64) for r in chosen])
                n_allowed = len(allowed)
            else:
                n_allowed = int(state.index.ntotal) - state.dead
            k = min(top_k, n_allowed)
            if k == 0:
                return []
            scores, ids = self._faiss_search(q, k, allowed)
            if len(ids) < k:
                # HNSW under a narrow filter can end its graph walk before finding k allowed ids.
                scores, ids = self._exact_search(q, k, allowed)
            return [self._hit(int(i), float(s)) for s, i in zip(scores, ids, strict=True)]

    def _select(self, document_ids: list[str] | None, filters: dict | None) -> list[_Doc]:
        docs = self._state.docs
        names = docs.keys() if document_ids is None else dict.fromkeys(d for d in document_ids if d in docs)
        chosen = []
        for name in names:
            doc = docs[name]
            if filters and not all(k in doc.metadata and doc.metadata[k] == v for k, v in filters.items()):
                continue
            chosen.append(doc)
        return chosen

    def _faiss_search(self, q: np.ndarray, k: int, allowed: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        state = self._state
        sel = None
        if allowed is not None:
            sel = faiss.IDSelectorBatch(allowed)
        elif state.tombstones:
            dead = np.concatenate([np.arange(s, s + c, dtype=np.int64) for s, c in state.tombstones])
            batch = faiss.IDSelectorBatch(dead)
            sel = faiss.IDSelectorNot(batch)
        if self.index_type == "hnsw":
            params = faiss.SearchParametersHNSW(efSearch=max(self.settings.hnsw_ef_search, k))
            if sel is not None:
                params.sel = sel
        else:
            params = faiss.SearchParameters(sel=sel) if sel is not None else None
        with _omp_threads(1):
            scores, ids = state.index.search(q, k, params=params)
        keep = ids[0] >= 0
        return scores[0][keep], ids[0][keep]

    def _exact_search(self, q: np.ndarray, k: int, allowed: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        ids, xb = self._vectors_view()
        if allowed is None:
            allowed = np.concatenate(
                [np.arange(r.start, r.start + r.count, dtype=np.int64) for r in self._state.docs.values()]
            )
        rows = np.flatnonzero(np.isin(ids, allowed))
        scores = xb[rows] @ q[0]
        top = np.argsort(-scores, kind="stable")[:k]
        return scores[top], ids[rows[top]]

    def _hit(self, vid: int, score: float) -> Hit:
        pos = bisect.bisect_right(self._starts, vid) - 1
        doc_id = self._start_docs[pos]
        return Hit(doc_id, vid - self._state.docs[doc_id].start, score)

    # -- internals ----------------------------------------------------------------------------------

    def _new_faiss(self) -> Any:
        if self.index_type == "hnsw":
            inner = faiss.IndexHNSWFlat(self.dim, self.settings.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            inner.hnsw.efConstruction = self.settings.hnsw_ef_construction
        else:
            inner = faiss.IndexFlatIP(self.dim)
        return faiss.IndexIDMap2(inner)

    def _check_vectors(self, vectors: np.ndarray) -> np.ndarray:
        vecs = np.ascontiguousarray(np.asarray(vectors, dtype=np.float32))
        if vecs.ndim != 2 or vecs.shape[1] != self.dim:
            raise ValueError(f"vectors must have shape [n, {self.dim}], got {list(vecs.shape)}")
        return vecs

    @staticmethod
    def _add_locked(state: _State, doc_id: str, vecs: np.ndarray, meta: dict) -> None:
        start = state.next_id
        _add_vectors(state.index, vecs, np.arange(start, start + len(vecs), dtype=np.int64))
        state.docs[doc_id] = _Doc(start, len(vecs), meta)
        state.next_id = start + len(vecs)

    def _remove_locked(self, doc_id: str) -> int:
        state = self._state
        doc = state.docs.pop(doc_id, None)
        if doc is None:
            return 0
        pos = bisect.bisect_left(self._starts, doc.start)
        del self._starts[pos], self._start_docs[pos]
        if self.index_type == "hnsw":
            state.tombstones.append((doc.start, doc.count))
            if state.dead > self.settings.hnsw_compact_ratio * state.index.ntotal:
                self._compact()
        else:
            state.index.remove_ids(faiss.IDSelectorRange(doc.start, doc.start + doc.count))
        return doc.count

    def _index_starts(self, doc_id: str, start: int) -> None:
        # Ids only grow, so a new document's range sorts last; bisect keeps this right after a rebuild too.
        pos = bisect.bisect_left(self._starts, start)
        self._starts.insert(pos, start)
        self._start_docs.insert(pos, doc_id)

    def _install(self, state: _State) -> None:
        self._state = state
        pairs = sorted((r.start, d) for d, r in state.docs.items())
        self._starts = [s for s, _ in pairs]
        self._start_docs = [d for _, d in pairs]

    def _vectors_view(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, vectors) of every stored vector in FAISS's internal order; the vectors are a view."""
        index = self._state.index
        inner = faiss.downcast_index(index.index)
        flat = faiss.downcast_index(inner.storage) if isinstance(inner, faiss.IndexHNSW) else inner
        n = int(flat.ntotal)
        ids = faiss.vector_to_array(index.id_map).astype(np.int64, copy=False)
        if n == 0:
            return ids, np.zeros((0, self.dim), dtype=np.float32)
        xb = faiss.rev_swig_ptr(flat.get_xb(), n * self.dim).reshape(n, self.dim)
        return ids, xb

    def _compact(self) -> None:
        """Rebuild the configured index type from the live stored vectors (drops tombstones)."""
        ids, xb = self._vectors_view()
        state = self._state
        dead = [np.arange(s, s + c, dtype=np.int64) for s, c in state.tombstones]
        keep = ~np.isin(ids, np.concatenate(dead)) if dead else np.ones(len(ids), dtype=bool)
        index = self._new_faiss()
        if keep.any():
            _add_vectors(index, np.ascontiguousarray(xb[keep]), np.ascontiguousarray(ids[keep]))
        self._state = _State(index, state.docs, state.next_id, [])
        self._dirty = True


def _generation_of(path: Path) -> int:
    try:
        return int(path.stem.split("-", 1)[1])
    except (IndexError, ValueError):
        return 0


def _add_vectors(index: Any, vecs: np.ndarray, ids: np.ndarray) -> None:
    with _omp_threads(1 if len(vecs) < PARALLEL_ADD_MIN else None):
        index.add_with_ids(vecs, ids)


@contextlib.contextmanager
def _omp_threads(n: int | None) -> Iterator[None]:
    """Run FAISS on `n` OpenMP threads (None: unchanged) in this block.

    One query gains nothing from OpenMP, but IndexIDMap still opens a parallel region to map its labels;
    on a busy CPU that region waits for a descheduled thread (measured: 0.1 ms searches taking 24 ms).
    The OpenMP thread count is per OS thread, so this does not touch other threads' adds or searches."""
    if n is None:
        yield
        return
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(n)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)


def _json_copy(metadata: dict, doc_id: str) -> dict:
    """The metadata as it will read back from the sidecar (tuples become lists, keys strings)."""
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata of {doc_id!r} must be a dict, got {type(metadata).__name__}")
    try:
        return json.loads(json.dumps(metadata))
    except (TypeError, ValueError) as err:
        raise ValueError(f"metadata of {doc_id!r} is not JSON-serializable: {err}") from err


def _seal(body: dict) -> bytes:
    """The sidecar carries a checksum of its own body: a truncated or edited sidecar is detected."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return json.dumps({"sha256": hashlib.sha256(text.encode()).hexdigest(), "body": body}, indent=1).encode()


def _unseal(data: bytes, path: Path) -> dict:
    try:
        outer = json.loads(data)
        body = outer["body"]
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        ok = hashlib.sha256(text.encode()).hexdigest() == outer["sha256"]
    except (ValueError, KeyError, TypeError) as err:
        raise IndexLoadError(f"{path} is unreadable ({type(err).__name__}: {err}): torn or corrupt sidecar") from err
    if not ok:
        raise IndexLoadError(f"{path} fails its checksum: torn or edited sidecar")
    return body
