"""The FAISS side of the vector index: what it holds in memory and the FAISS calls made on it.

`IndexState` is everything a save writes (the FAISS index, each document's id range, the id counter,
HNSW tombstones); `VectorIndex` (index.py) swaps it as a whole. The helpers build an index of the
configured type, add vectors on a suitable number of OpenMP threads, and read the stored vectors back
(for exact search and compaction) without copying them.

Index types (`retriever.index_type`): `flat` is exact inner product (cosine on normalized vectors);
`hnsw` is approximate and scales to large corpora. Both sit in an `IndexIDMap2`, so ids are ours.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import faiss
import numpy as np

from kvfuse.config import DEFAULT_COLLECTION, RetrieverSettings

# Adds smaller than this run on one OpenMP thread: a document's few chunks are too little work to share,
# and each parallel region waits at a barrier for every thread, which on a busy machine costs more than
# the add itself. A rebuild adds everything at once and uses every thread. `kvfuse bench retriever`
# measures build and search times.
PARALLEL_ADD_MIN = 4096


@dataclass
class DocRange:
    """A document's chunk vectors: ids [start, start + count), chunk i has id start + i; its metadata and
    collection, which searches filter on."""

    start: int
    count: int
    metadata: dict[str, Any]
    collection: str = DEFAULT_COLLECTION


@dataclass
class IndexState:
    """Everything a save writes; swapped as a whole by a rebuild or a compaction."""

    index: Any  # faiss.IndexIDMap2
    docs: dict[str, DocRange]
    next_id: int = 0
    tombstones: list[tuple[int, int]] = field(default_factory=list)  # (start, count) ranges (hnsw)

    @property
    def dead(self) -> int:
        """Vectors still in the FAISS index that belong to removed documents."""
        return sum(c for _, c in self.tombstones)

    @property
    def live(self) -> int:
        return int(self.index.ntotal) - self.dead


def new_faiss(dim: int, settings: RetrieverSettings) -> Any:
    """An empty index of the configured type, in an IndexIDMap2 (inner product)."""
    if settings.index_type == "hnsw":
        inner = faiss.IndexHNSWFlat(dim, settings.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        inner.hnsw.efConstruction = settings.hnsw_ef_construction
    else:
        inner = faiss.IndexFlatIP(dim)
    return faiss.IndexIDMap2(inner)


def id_ranges(ranges: Iterable[tuple[int, int]]) -> np.ndarray:
    """Every id of the (start, count) ranges, as one int64 array."""
    parts = [np.arange(start, start + count, dtype=np.int64) for start, count in ranges]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def add_vectors(index: Any, vecs: np.ndarray, ids: np.ndarray) -> None:
    with omp_threads(1 if len(vecs) < PARALLEL_ADD_MIN else None):
        index.add_with_ids(vecs, ids)


def stored_vectors(index: Any, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, vectors) of every stored vector in FAISS's internal order; the vectors are a view."""
    inner = faiss.downcast_index(index.index)
    flat = faiss.downcast_index(inner.storage) if isinstance(inner, faiss.IndexHNSW) else inner
    n = int(flat.ntotal)
    ids = faiss.vector_to_array(index.id_map).astype(np.int64, copy=False)
    if n == 0:
        return ids, np.zeros((0, dim), dtype=np.float32)
    xb = faiss.rev_swig_ptr(flat.get_xb(), n * dim).reshape(n, dim)
    return ids, xb


@contextlib.contextmanager
def omp_threads(n: int | None) -> Iterator[None]:
    """Run FAISS on `n` OpenMP threads (None: unchanged) in this block.

    One query gains nothing from OpenMP, but IndexIDMap still opens a parallel region to map its labels;
    on a busy CPU that region waits for a descheduled thread, which can cost far more than the search.
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
