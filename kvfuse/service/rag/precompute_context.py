"""What each chunk of a document being ingested is precomputed after (`store.precompute_context`).

The API side of kvfuse/fusion/chunk_context.py: the context's tokens are chosen here, where the stored
documents and the index are, and sent with the precompute job; the worker computes each chunk after its
context and keys it by both (docs/DESIGN.md, "Context-carrying chunk caches"). Modes:

- `none`: every chunk alone (no context), as before the setting existed.
- `document`: the last `precompute_context_tokens` tokens before the chunk in its own document.
- `prefix`: the system prefix of the configured default system prompt (the chat template up to the user's
  content), so no chunk starts a sequence.
- `sink`: the BOS token alone: one shared attention sink, independent of any system prompt.
- `neighbours`: the `precompute_neighbours` chunks most similar to it (embedding cosine) among the other
  chunks of its document and the ready chunks of every other document of its collection in the index,
  least similar first, cut to the same budget. Chosen once, at ingestion: later documents do not
  recompute earlier ones. Never from another collection: a chunk's KV carries its context's content, and
  a query of one collection must not be answered with text of another shaping it.
- `document_or_neighbours` (the default): `document` for a chunk with text before it, `neighbours` for one
  without (a document's first chunk: every chunk of a one-chunk document).

For a tokenizer that adds a BOS (Gemma's), every mode's context starts with it, `none` included
(`chunk_context.sequence_start`, `starting_with`: why is said there); the record keeps it beside the span.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvfuse.config import DEFAULT_COLLECTION
from kvfuse.fusion import chunk_context

if TYPE_CHECKING:
    from kvfuse.service.rag.corpus import Corpus


def contexts_for(corpus: Corpus, doc_id: str, chunk_ids: list[list[int]], vectors: Any,
                 collection: str = DEFAULT_COLLECTION) -> list[list[int]]:
    """One context (token ids, [] = alone) per chunk of `doc_id`, each starting with the sequence's BOS
    where the tokenizer adds one. Reads the store and the index: call it in a thread."""
    contexts = _mode_contexts(corpus, doc_id, chunk_ids, vectors, collection)
    return chunk_context.starting_with(sequence_start(corpus), contexts,
                                       corpus.settings.store.precompute_context_tokens)


def sequence_start(corpus: Corpus) -> list[int]:
    """What every chunk context of this corpus's model starts with ([BOS] or [])."""
    return chunk_context.sequence_start(corpus.chunker.tokenizer)


def _mode_contexts(corpus: Corpus, doc_id: str, chunk_ids: list[list[int]], vectors: Any,
                   collection: str) -> list[list[int]]:
    """The configured mode's contexts, before the BOS (`contexts_for`)."""
    s = corpus.settings.store
    mode, budget = chunk_context.check_mode(s.precompute_context), s.precompute_context_tokens
    if mode == "none" or budget <= 0:
        return [[] for _ in chunk_ids]
    if mode in ("document", "document_or_neighbours"):
        contexts = chunk_context.document_contexts(chunk_ids, budget)
        if mode == "document":
            return contexts
        return chunk_context.fill_empty(contexts, lambda rows: _neighbour_contexts(
            corpus, doc_id, collection, chunk_ids, np.asarray(vectors, dtype=np.float32),
            s.precompute_neighbours, budget, rows))
    if mode == "sink":
        return [chunk_context.sink_context(corpus.chunker.tokenizer) for _ in chunk_ids]
    if mode == "prefix":
        from kvfuse.fusion.prompt import template_halves

        before, _ = template_halves(corpus.chunker.tokenizer, corpus.settings.model.system_prompt)
        prefix = chunk_context.joined([corpus.chunker.encode(before)], budget)
        return [list(prefix) for _ in chunk_ids]
    return _neighbour_contexts(corpus, doc_id, collection, chunk_ids, np.asarray(vectors, dtype=np.float32),
                               s.precompute_neighbours, budget)


def _neighbour_contexts(corpus: Corpus, doc_id: str, collection: str, chunk_ids: list[list[int]],
                        vectors: np.ndarray, n: int, budget: int,
                        rows: list[int] | None = None) -> list[list[int]]:
    """The `neighbours` context of each chunk in `rows` (default: every chunk), in that order."""
    own = vectors @ vectors.T
    previous = corpus.store.get_document(doc_id)
    # The document's previous version is still in the index: ask for enough hits to skip all of it.
    top_k = n + (len(previous.chunk_keys) if previous is not None else 0)
    records: dict[str, Any] = {}
    out = []
    for i in range(len(chunk_ids)) if rows is None else rows:
        vec = vectors[i]
        scored: list[tuple[float, list[int]]] = [(float(own[i, j]), chunk_ids[j])
                                                 for j in range(len(chunk_ids)) if j != i]
        found = corpus.index.search(vec, top_k, collections=[collection]) if corpus.index is not None else []
        for hit in found:
            tokens = _chunk_tokens(corpus, records, hit.document_id, hit.chunk_index, doc_id)
            if tokens is not None:
                scored.append((float(hit.score), tokens))
        out.append(chunk_context.nearest_context(scored, n, budget))
    return out


def _chunk_tokens(corpus: Corpus, records: dict[str, Any], doc_id: str, index: int,
                  ingesting: str) -> list[int] | None:
    """The tokens of chunk `index` of another ready document; None for the document being ingested, or
    one deleted or changed since the search."""
    if doc_id == ingesting:
        return None
    if doc_id not in records:
        records[doc_id] = corpus.store.get_document(doc_id)
    rec = records[doc_id]
    if rec is None or rec.status != "ready" or index >= len(rec.chunk_tokens):
        return None
    try:
        return corpus.chunk_token_ids(rec)[index]
    except Exception:  # noqa: BLE001 - a neighbour that cannot be read is skipped, never fails the ingestion
        return None


# -- the context recorded with each chunk ------------------------------------------------------------------
# A chunk missing from every tier (never computed under `store.precompute_at: first_use`, or evicted) is
# computed after exactly the context eager ingestion used, so its KV is the same, bit for bit: the record
# names where those tokens come from (DocumentRecord.chunk_context_src). A context that is the text before
# the chunk in its own document is a span of the document's tokens (always rebuilt from its stored text);
# any other (neighbours, which depend on the index at ingestion, a prefix, a sink) is kept as token ids.


def context_sources(chunk_ids: list[list[int]], contexts: list[list[int]], start: Sequence[int] = ()) -> list[dict]:
    """Per chunk, where its context's tokens come from: {"span": [a, b]} of the document's tokens (after
    {"start": `start`} when the context begins with the sequence's BOS and the rest is that span),
    {"ids": [...]}, or {} for none."""
    doc = [t for ids in chunk_ids for t in ids]
    head = [int(t) for t in start]
    out, pos = [], 0
    for ids, ctx in zip(chunk_ids, contexts, strict=True):
        lead = head if head and list(ctx[: len(head)]) == head else []
        rest = list(ctx[len(lead) :])
        n = len(rest)
        if not ctx:
            out.append({})
        elif n and n <= pos and doc[pos - n : pos] == rest:
            out.append({"start": lead, "span": [pos - n, pos]} if lead else {"span": [pos - n, pos]})
        else:
            out.append({"ids": [int(t) for t in ctx]})
        pos += len(ids)
    return out


def recorded_contexts(corpus: Corpus, rec: Any) -> list[list[int] | None]:
    """Per chunk of a ready document, the tokens its KV is computed after ([] = alone), checked against
    the context hash its key holds; None where they cannot be known (a record from before contexts were
    recorded whose context is not its document's text before it under today's budget). Reads the store
    (the document's tokens, cached per version): call it in a thread."""
    from kvfuse.chunk_keys import context_hash

    if not rec.chunk_contexts:
        return [[] for _ in rec.chunk_keys]
    raw = corpus.chunk_token_ids(rec)
    doc = [t for ids in raw for t in ids]
    if rec.chunk_context_src:
        found = [list(s.get("start", ())) + doc[s["span"][0] : s["span"][1]] if "span" in s
                 else list(s.get("ids", ())) for s in rec.chunk_context_src]
    else:  # not recorded: its own text before it, if that is what it was computed after
        found = chunk_context.document_contexts(raw, corpus.settings.store.precompute_context_tokens)
    return [ctx if context_hash(ctx) == want else None
            for ctx, want in zip(found, rec.chunk_contexts, strict=True)]
