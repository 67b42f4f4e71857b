"""Which chunks a query retrieves: the mode (dense, keyword or hybrid), the collections searched and the
metadata filters, resolved against the request and the settings, with the errors a client can act on.

The vector index owns what a document is filtered on (its metadata and collection: `VectorIndex.select`);
the keyword index searches the same selection, so filters and collections mean the same in every mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvfuse.config import DEFAULT_COLLECTION
from kvfuse.retriever.errors import FilterTypeError
from kvfuse.retriever.hybrid import RankedHit, search
from kvfuse.service.errors import APIError

if TYPE_CHECKING:
    from kvfuse.config import Settings
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


def retrieve(corpus: Corpus, question: str, top_k: int, opts: RetrievalOptions,
             filters: dict | None) -> list[RankedHit]:
    """The top_k chunks for `question`, best first, each with its rank in the lists it came from. Reads
    the indexes and embeds the question: call it in a thread."""
    if opts.mode == "keyword" and not corpus.keyword.terms(question):
        raise APIError(422, "the query has no searchable keywords (only stopwords, punctuation or one-character "
                            "words): keyword retrieval needs one; use retrieval.mode dense or hybrid",
                       code="empty_keyword_query", param="query")
    return search(opts.mode, question, top_k, embed=lambda q: corpus.embedder.embed([q])[0], dense=corpus.index,
                  keyword=corpus.keyword, document_ids=_selection(corpus, opts, filters), rrf_k=opts.rrf_k,
                  candidates=opts.candidates)


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
    try:
        return corpus.index.select(filters=filters, collections=opts.searched)
    except FilterTypeError as err:
        raise APIError(422, str(err), code="filter_type_mismatch", param=f"filters.{err.field}") from None
