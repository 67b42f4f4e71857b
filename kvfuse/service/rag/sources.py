"""The chunks a query is answered from, as the worker will read them: each with its store key under the
model running now, its token ids as the prompt renders them, and what a citation shows (its text, its
document's metadata, its page or section, its document's name in the labelled prompt).

The selection itself (a named document's chunks; a retrieval's hits in the prompt's order) is a set of
functions over the corpus and a key function, so `kvfuse calibrate` picks a query's chunks with the
same code as the service without its dispatcher, metrics or ingestion jobs; `Sources` adds what serving
needs around it (the caller's collections, documents still being ingested, stale KV rebuilt).

A key is never taken from the record on trust: KV stored for another model (weights, tokenizer, dtypes)
or another prompt layout is a miss, rebuilt from the tokens, and its document is rebuilt in the
background. KV of this model in another format at rest (`store.kv_dtype` changed since) is the same
cache stored otherwise: it is read as it is (`kvfuse store convert` rewrites it).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from kvfuse.chunk_keys import FORMATS, chunk_key_from_hash, token_hash
from kvfuse.fusion.prompt import in_prompt_order
from kvfuse.service.errors import APIError, document_not_found, retry_after
from kvfuse.service.rag.chunks import document_chunks, found_chunks
from kvfuse.service.rag.precompute_context import recorded_contexts
from kvfuse.service.rag.retrieval import retrieve

if TYPE_CHECKING:
    from kvfuse.config import Settings
    from kvfuse.service.metrics import Metrics
    from kvfuse.service.rag.corpus import Corpus
    from kvfuse.service.rag.ingest import IngestManager
    from kvfuse.service.rag.retrieval import RetrievalOptions

log = logging.getLogger(__name__)


@dataclass
class SourceChunk:
    document_id: str
    chunk_index: int
    score: float
    key: str
    token_ids: list[int]
    dense_rank: int | None = None
    keyword_rank: int | None = None
    text: str = ""  # what the chunk covers of its document (rag/chunks.py), for citations
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)  # its document's
    location: dict[str, Any] = dataclasses.field(default_factory=dict)  # its page or section, from a file
    name: str = ""  # its document's name in the labelled prompt ("" in the plain one)
    # the tokens its KV is computed after ([] = alone), so the worker computes a chunk in no tier exactly as
    # ingestion would have (precompute_context.recorded_contexts); None: not known (an old record)
    context: list[int] | None = dataclasses.field(default_factory=list)


KeyOf = Callable[[Any, int, list[int]], str]  # (document record, chunk index, token ids) -> store key


def chunk_key_now(fingerprint: str, kv_dtype: str, rec: Any, i: int, token_ids: list[int]) -> str:
    """Chunk i's key under the model `fingerprint`: its tokens and the context its KV was computed after
    (from the document's record). The service's queries and `kvfuse calibrate` key chunks this way."""
    context = rec.chunk_contexts[i] if rec.chunk_contexts else ""
    return chunk_key_from_hash(fingerprint, kv_dtype, token_hash(token_ids), context)


def in_another_format(fingerprint: str, kv_dtype: str, rec: Any, i: int, token_ids: list[int]) -> bool:
    """Whether chunk i's recorded key names its KV under the model `fingerprint` in a KV format other than
    `kv_dtype`: a store may hold several formats, and any of them reads."""
    context = rec.chunk_contexts[i] if rec.chunk_contexts else ""
    th = token_hash(token_ids)
    return any(chunk_key_from_hash(fingerprint, f, th, context) == rec.chunk_keys[i] for f in FORMATS if f != kv_dtype)


def document_source_chunks(corpus: Corpus, rec: Any, key: KeyOf) -> list[SourceChunk]:
    """Every chunk of a ready document, in order, as the prompt renders it. Reads the store: call it in a
    thread."""
    found, name = document_chunks(corpus, rec), corpus.prompt_name(rec)
    contexts = recorded_contexts(corpus, rec)
    out = []
    for i, ids in enumerate(corpus.prompt_chunk_ids(rec)):
        c = found[i]
        out.append(SourceChunk(rec.id, i, 1.0, key(rec, i, ids), ids, text=c.text, metadata=c.metadata,
                               location=c.location, name=name, context=contexts[i]))
    return out


def hit_source_chunks(corpus: Corpus, hits: list[Any], key: KeyOf) -> list[SourceChunk]:
    """The chunks of a retrieval's hits, best first; those deleted or re-ingested since the search are
    left out. Reads the store: call it in a thread."""
    chunks = []
    records: dict[str, Any] = {}
    contexts: dict[str, list[list[int] | None]] = {}
    for c in found_chunks(corpus, hits):
        if c.document_id not in records:
            records[c.document_id] = corpus.store.get_document(c.document_id)
        rec = records[c.document_id]
        if rec is None or rec.status != "ready" or c.chunk_index >= len(rec.chunk_keys):
            continue
        if c.document_id not in contexts:
            contexts[c.document_id] = recorded_contexts(corpus, rec)
        ids = corpus.prompt_chunk_ids(rec)[c.chunk_index]
        chunks.append(SourceChunk(c.document_id, c.chunk_index, c.score, key(rec, c.chunk_index, ids), ids,
                                  c.dense_rank, c.keyword_rank, c.text, c.metadata, c.location,
                                  corpus.prompt_name(rec), contexts[c.document_id][c.chunk_index]))
    return chunks


def searched_source_chunks(corpus: Corpus, question: str, top_k: int, opts: RetrievalOptions,
                           filters: dict | None, key: KeyOf, prompt_order: str) -> list[SourceChunk]:
    """The top_k chunks retrieved for `question`, in the prompt's order (`model.prompt_order`); [] when
    none is ready. Embeds the question and reads the store: call it in a thread."""
    hits = retrieve(corpus, question, top_k, opts, filters)
    return in_prompt_order(hit_source_chunks(corpus, hits, key), prompt_order)


class Sources:
    """Chunks from a query's documents or hits, keyed under the model running now (`dispatcher.info`)."""

    def __init__(self, settings: Settings, metrics: Metrics, dispatcher: Any, ingest: IngestManager,
                 corpus: Corpus) -> None:
        self.settings = settings
        self.metrics = metrics
        self.dispatcher = dispatcher
        self.ingest = ingest
        self.corpus = corpus
        self._stale_logged: set[str] = set()  # documents with KV of another model, logged once each

    def key(self, rec: Any, i: int, token_ids: list[int]) -> str:
        """Chunk i's key under the model running now (and the context its KV was computed after, from the
        record), never the key recorded at ingest: KV stored for
        another model (weights, tokenizer, dtypes) is a miss, rebuilt from the tokens. A document built
        for another model is counted, logged once, and rebuilt for this one in the background. KV of this
        model in another format at rest is read under its recorded key."""
        fp = self.dispatcher.info.get("fingerprint")
        if not fp:  # no worker yet: the query waits for one, which will have this model
            return rec.chunk_keys[i]
        key = chunk_key_now(fp, self.settings.store.kv_dtype, rec, i, token_ids)
        if key != rec.chunk_keys[i] and in_another_format(fp, self.settings.store.kv_dtype, rec, i, token_ids):
            return rec.chunk_keys[i]
        if key != rec.chunk_keys[i]:
            self.metrics.fingerprint_misses.inc()
            if rec.id not in self._stale_logged:
                self._stale_logged.add(rec.id)
                log.warning("document %s has KV of another model (or KV dtype, or prompt layout): its chunks are rebuilt from "
                            "their tokens at each query until the document is rebuilt for this model", rec.id)
                self.ingest.resubmit_soon(rec.id, "its KV is from another model")
        return key

    def named(self, document_ids: list[str], visible: frozenset[str] | None) -> list[SourceChunk]:
        """The chunks of the caller's `document_ids`, in order: each document must exist, be ready and lie
        in a `visible` collection (None = every one)."""
        if len(set(document_ids)) != len(document_ids):
            raise APIError(422, "document_ids contains duplicates", code="invalid_value", param="document_ids")
        chunks: list[SourceChunk] = []
        for doc_id in document_ids:
            rec = self.corpus.store.get_document(doc_id)
            job = self.ingest.unfinished(doc_id)
            owner = job.rec.collection if job is not None else rec.collection if rec is not None else None
            if visible is not None and owner not in visible:
                raise document_not_found(doc_id, param="document_ids")
            if rec is None or rec.status != "ready":
                self.not_ready(doc_id, rec)
            chunks.extend(document_source_chunks(self.corpus, rec, self.key))
        return chunks

    def not_ready(self, doc_id: str, rec: Any) -> NoReturn:
        """Why a named document cannot be used: a document still being ingested (first version, so no
        record yet, or one that has none good) is 409 with Retry-After, as GET /v1/documents/{id} says
        `processing`; a failed one is 409 without; an unknown one 404."""
        job = self.ingest.unfinished(doc_id)
        if job is not None:
            raise APIError(409, f"document {doc_id!r} is being ingested (job {job.id}) and is not ready yet; "
                           "retry later", code="document_not_ready", param="document_ids",
                           headers=retry_after(self.settings))
        if rec is None:
            raise document_not_found(doc_id, param="document_ids")
        raise APIError(409, f"document {doc_id!r} is {rec.status}, not ready", code="document_not_ready",
                       param="document_ids")

    def searched(self, question: str, top_k: int, opts: RetrievalOptions, filters: dict | None) -> list[SourceChunk]:
        """The chunks retrieved for `question`, in the prompt's order; 404 when none is ready. Call it in
        a thread."""
        chunks = searched_source_chunks(self.corpus, question, top_k, opts, filters, self.key,
                                        self.settings.model.prompt_order)
        if not chunks:
            raise APIError(404, "no ready document matches the query (ingest documents first, or relax filters)",
                           code="no_documents")
        return chunks
