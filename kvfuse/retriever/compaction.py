"""Compaction: rebuilding the FAISS index from its own stored vectors.

HNSW cannot delete a vector, so a removed document's id range becomes a tombstone that searches exclude;
once tombstones exceed `retriever.hnsw_compact_ratio` of the index, it is rebuilt from the live
vectors it already stores (no re-embedding). The same rebuild converts a saved index of the other type
to the configured one when it is opened.
"""

from __future__ import annotations

import numpy as np

from kvfuse.config import RetrieverSettings
from kvfuse.retriever.faiss_index import IndexState, add_vectors, id_ranges, new_faiss, stored_vectors


def needs_compaction(state: IndexState, settings: RetrieverSettings) -> bool:
    return state.dead > settings.hnsw_compact_ratio * state.index.ntotal


def compacted(state: IndexState, dim: int, settings: RetrieverSettings) -> IndexState:
    """A new state of the configured index type holding `state`'s live vectors (tombstones dropped)."""
    ids, xb = stored_vectors(state.index, dim)
    keep = ~np.isin(ids, id_ranges(state.tombstones))
    index = new_faiss(dim, settings)
    if keep.any():
        add_vectors(index, np.ascontiguousarray(xb[keep]), np.ascontiguousarray(ids[keep]))
    return IndexState(index, state.docs, state.next_id, [])
