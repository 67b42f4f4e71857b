"""What a document's record keeps of each chunk's precompute context (precompute_context.context_sources):
the text before a chunk in its own document as a span of the document's tokens, anything else as its
token ids, so that a chunk in no tier is computed after exactly that context again; a context that starts
with the sequence's BOS (a tokenizer that adds one) keeps it beside the span."""

from __future__ import annotations

from kvfuse.fusion.chunk_context import document_contexts, neighbour_contexts, starting_with
from kvfuse.service.rag.precompute_context import context_sources


def _resolve(chunks: list[list[int]], sources: list[dict]) -> list[list[int]]:
    """What precompute_context.recorded_contexts rebuilds from a record's sources."""
    doc = [t for c in chunks for t in c]
    return [list(s.get("start", ())) + doc[s["span"][0] : s["span"][1]] if "span" in s else list(s.get("ids", ()))
            for s in sources]


def test_document_contexts_are_spans_of_the_document_and_others_their_ids() -> None:
    chunks = [list(range(0, 7)), list(range(7, 12)), list(range(12, 20)), list(range(20, 23))]
    own = document_contexts(chunks, 6)
    spans = context_sources(chunks, own)
    assert spans == [{}, {"span": [1, 7]}, {"span": [6, 12]}, {"span": [14, 20]}]
    assert _resolve(chunks, spans) == own

    # A first chunk's neighbours (document_or_neighbours), a shared prefix: not a span of the text before
    # the chunk, so kept as ids; a context that happens to be the text before it is a span again.
    vectors = [[1.0, 0.0], [0.0, 1.0], [0.7, 0.7], [1.0, 0.1]]
    first = neighbour_contexts(chunks, vectors, 1, 6)[0]
    mixed = [first, [99, 98], own[2], [5, 6, 7, 8, 9, 10, 11]]
    sources = context_sources(chunks, mixed)
    assert sources[0] == {"ids": first} and sources[1] == {"ids": [99, 98]}
    assert sources[2] == {"span": [6, 12]} and sources[3] == {"ids": [5, 6, 7, 8, 9, 10, 11]}
    assert _resolve(chunks, sources) == mixed


def test_a_context_after_the_sequence_bos_keeps_its_span_and_the_bos_beside_it() -> None:
    chunks = [list(range(0, 7)), list(range(7, 12)), list(range(12, 20)), list(range(20, 23))]
    bos = [500]
    own = starting_with(bos, document_contexts(chunks, 6), 6)  # the BOS and the last 5 tokens before each
    assert own == [[500], [500, 2, 3, 4, 5, 6], [500, 7, 8, 9, 10, 11], [500, 15, 16, 17, 18, 19]]
    sources = context_sources(chunks, own, bos)
    assert sources == [{"ids": [500]}, {"start": [500], "span": [2, 7]}, {"start": [500], "span": [7, 12]},
                       {"start": [500], "span": [15, 20]}]
    assert _resolve(chunks, sources) == own
    # a neighbour after the BOS is not a span of the text before the chunk: its ids, the BOS among them
    assert context_sources(chunks, [[500, 99], *own[1:]], bos)[0] == {"ids": [500, 99]}
    # no start given: the same contexts are kept as ids (what a record would hold without it)
    assert context_sources(chunks, own)[1] == {"ids": own[1]}
