"""Reciprocal rank fusion of the dense and keyword rankings (Cormack, Clarke and Büttcher, SIGIR 2009).

A chunk's fused score is the sum over the lists it appears in of 1 / (k + rank), ranks from 1. Only ranks
count, not the lists' scores: cosine similarities and BM25 scores live on unrelated scales, and RRF needs
no calibration between them. k damps the head of each list (k = 60 in the paper; `retriever.rrf_k`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvfuse.retriever.results import Hit

if TYPE_CHECKING:
    from kvfuse.retriever.index import VectorIndex
    from kvfuse.retriever.keyword_index import KeywordIndex

MODES = ("dense", "keyword", "hybrid")


@dataclass(frozen=True)
class RankedHit:
    """A retrieved chunk with its place in each ranking it came from (1-based; None: not in that list)."""

    document_id: str
    chunk_index: int
    score: float  # the mode's own: cosine (dense), BM25 (keyword), fused 1 / (k + rank) sum (hybrid)
    dense_rank: int | None = None
    keyword_rank: int | None = None


def ranked(hits: list[Hit], source: str) -> list[RankedHit]:
    """One list's hits with their ranks (`source`: "dense" or "keyword")."""
    key = f"{source}_rank"
    return [RankedHit(h.document_id, h.chunk_index, h.score, **{key: i}) for i, h in enumerate(hits, 1)]


def reciprocal_rank_fusion(dense: list[Hit], keyword: list[Hit], *, k: int, top_k: int) -> list[RankedHit]:
    """The top_k chunks of both rankings by fused score, best first. Ties go to the chunk with the better
    single rank, then to the dense list's order (deterministic)."""
    ranks: dict[tuple[str, int], list[int | None]] = {}
    for i, h in enumerate(dense, 1):
        ranks.setdefault((h.document_id, h.chunk_index), [None, None])[0] = i
    for i, h in enumerate(keyword, 1):
        ranks.setdefault((h.document_id, h.chunk_index), [None, None])[1] = i
    fused = [RankedHit(doc, chunk, sum(1.0 / (k + r) for r in (d, w) if r is not None), d, w)
             for (doc, chunk), (d, w) in ranks.items()]
    inf = float("inf")
    fused.sort(key=lambda h: (-h.score, min(h.dense_rank or inf, h.keyword_rank or inf), h.dense_rank or inf))
    return fused[:top_k]


def search(mode: str, question: str, top_k: int, *, embed: Callable[[str], np.ndarray], dense: VectorIndex,
           keyword: KeywordIndex, document_ids: list[str] | None = None, rrf_k: int = 60,
           candidates: int = 50) -> list[RankedHit]:
    """The top_k chunks for `question` in one mode, among `document_ids` (None: all). Hybrid reads
    max(top_k, candidates) of each list and fuses them; a question with no keyword (only stopwords) is
    then dense alone. Keyword mode never embeds the question."""
    if mode not in MODES:
        raise ValueError(f"unknown retrieval mode {mode!r}; one of {', '.join(MODES)}")
    if mode == "keyword":
        return ranked(keyword.search(question, top_k, document_ids=document_ids), "keyword")
    vec = embed(question)
    if mode == "dense":
        return ranked(dense.search(vec, top_k, document_ids=document_ids), "dense")
    depth = max(top_k, candidates)
    return reciprocal_rank_fusion(dense.search(vec, depth, document_ids=document_ids),
                                  keyword.search(question, depth, document_ids=document_ids), k=rrf_k, top_k=top_k)

