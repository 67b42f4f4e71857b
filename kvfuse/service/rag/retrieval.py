"""Which chunks a query retrieves: the mode (dense, keyword or hybrid), the collections searched and the
metadata filters, resolved against the request and the settings, with the errors a client can act on.

The vector index owns what a document is filtered on (its metadata and collection: `VectorIndex.select`);
the keyword index searches the same selection, so filters and collections mean the same in every mode.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvfuse.config import DEFAULT_COLLECTION
from kvfuse.retriever.errors import FilterSyntaxError, FilterTypeError
from kvfuse.retriever.filters import parse as parse_filter
from kvfuse.retriever.hybrid import RankedHit, search
from kvfuse.service.errors import APIError
from kvfuse.service.rag.chunks import FoundChunk, found_chunks

if TYPE_CHECKING:
    from kvfuse.config import Settings
    from kvfuse.service.metrics import Metrics
    from kvfuse.service.rag.corpus import Corpus


@dataclass(frozen=True)
class RetrievalOptions:
    mode: str
    collections: list[str] | None  # None: the default collection, not named by the client
    rrf_k: int
    candidates: int
    # The collections the caller's API key sees (api/auth.py); None = every one. Others answer as absent.
    visible: frozenset[str] | None = None

    @property
    def searched(self) -> list[str]:
        """The named collections; else the default one, or for a key limited to collections, its own."""
        if self.collections:
            return self.collections
        return [DEFAULT_COLLECTION] if self.visible is None else sorted(self.visible)


def retrieval_options(settings: Settings, retrieval: Any | None,
                      visible: frozenset[str] | None = None) -> RetrievalOptions:
    """The request's `retrieval` object over the configured defaults (`retriever.mode`, ...), confined to
    the `visible` collections (a search route passes its caller's `allowed_collections`)."""
    r = settings.retriever
    given = retrieval.model_dump(exclude_none=True) if retrieval is not None else {}
    return RetrievalOptions(mode=given.get("mode", r.mode), collections=given.get("collections"),
                            rrf_k=given.get("rrf_k", r.rrf_k), candidates=given.get("candidates", r.candidates),
                            visible=visible)


def check_question(settings: Settings, question: str, top_k: int | None) -> None:
    """422 for a question retrieval cannot search with, or a top_k over `retriever.max_top_k`."""
    if not question.strip():
        raise APIError(422, "the question is empty or whitespace only", code="empty_query", param="query")
    limit = settings.retriever.max_top_k
    if top_k is not None and top_k > limit:
        raise APIError(422, f"top_k {top_k} exceeds the limit of {limit}", code="invalid_value", param="top_k")


async def search_chunks(settings: Settings, metrics: Metrics, corpus: Corpus, *, question: str, top_k: int | None,
                        filters: dict | None, retrieval: Any | None, visible: frozenset[str] | None = None
                        ) -> tuple[list[FoundChunk], RetrievalOptions, float]:
    """Retrieval alone (`POST /v1/search`): the chunks /v1/query would put in the prompt for the same knobs,
    with their text and metadata, and the seconds it took. No model, no worker. `visible`: the collections
    the caller's key sees (None = every one)."""
    check_question(settings, question, top_k)
    opts = retrieval_options(settings, retrieval, visible)
    t0 = time.perf_counter()
    hits = await asyncio.to_thread(retrieve, corpus, question, top_k or settings.retriever.top_k, opts, filters)
    found = await asyncio.to_thread(found_chunks, corpus, hits)
    elapsed = time.perf_counter() - t0
    metrics.retrieval.observe(elapsed)
    return found, opts, elapsed


def retrieve(corpus: Corpus, question: str, top_k: int, opts: RetrievalOptions,
             filters: dict | None) -> list[RankedHit]:
    """The top_k chunks for `question`, best first, each with its rank in the lists it came from. Reads
    the indexes and embeds the question: call it in a thread."""
    if filters:  # a malformed filter is refused before the question is embedded
        check_filter(filters)
    if opts.mode == "keyword" and not corpus.keyword.terms(question):
        raise APIError(422, "the query has no searchable keywords (only stopwords, punctuation or one-character "
                            "words): keyword retrieval needs one; use retrieval.mode dense or hybrid",
                       code="empty_keyword_query", param="query")
    return search(opts.mode, question, top_k, embed=lambda q: corpus.embedder.embed([q])[0], dense=corpus.index,
                  keyword=corpus.keyword, document_ids=_selection(corpus, opts, filters), rrf_k=opts.rrf_k,
                  candidates=opts.candidates)


def check_filter(filters: dict) -> None:
    """422 `invalid_filter` naming the place, for a filter that is not one (retriever/filters.py)."""
    try:
        parse_filter(filters)
    except FilterSyntaxError as err:
        raise APIError(422, f"malformed filter: {err}", code="invalid_filter", param=err.path) from None


def _selection(corpus: Corpus, opts: RetrievalOptions, filters: dict | None) -> list[str] | None:
    """The documents a search may return; None when that is every indexed one (no scan needed)."""
    everything = corpus.index.collections()
    present = [c for c in everything if opts.visible is None or c in opts.visible]  # all the caller may know of
    unknown = [c for c in opts.collections or [] if c not in present]
    if unknown:
        raise APIError(404, f"no ready document in collection(s) {', '.join(map(repr, unknown))}; collections "
                            f"with documents: {', '.join(present) or 'none'}", code="collection_not_found",
                       param="retrieval.collections")
    if not filters and set(opts.searched) >= set(everything):
        return None
    return select(corpus, filters=filters, collections=opts.searched)


def select(corpus: Corpus, *, filters: dict | None, collections: list[str] | None) -> list[str]:
    """The indexed documents of `collections` (None: all) that pass `filters`, with the filter errors a
    client can act on (422 `invalid_filter`, 422 `filter_type_mismatch`)."""
    if filters:
        check_filter(filters)
    try:
        return corpus.index.select(filters=filters, collections=collections)
    except FilterTypeError as err:
        raise APIError(422, str(err), code="filter_type_mismatch", param=f"filters.{err.field}") from None
