"""Retrieval on real data: every essay chunked with the LLM's tokenizer, embedded with the default embedder,
indexed in FAISS; paraphrased sentences find their essay. Embedding all essays is the slow part (shared
by every test here through session fixtures)."""

from __future__ import annotations

import numpy as np
import pytest

from kvfuse.config import RetrieverSettings
from kvfuse.retriever import EmbedderError, VectorIndex

pytestmark = pytest.mark.slow

# A sentence of each essay, paraphrased (other words, same meaning), and the essay it comes from.
PARAPHRASES = {
    # "PR is the news equivalent of search engine optimization; instead of buying ads, which readers
    # ignore, you get yourself inserted directly into the stories."
    "submarine": "Public relations works like SEO for journalism: rather than paying for advertisements that "
    "people skip, you get placed inside the articles themselves.",
    # "I probably write three to four words for every one that appears in the final version of an essay."
    "laundry": "For each word that survives into the finished essay, I write roughly three or four that get cut.",
    # "In programming, as in many fields, the hard part isn't solving problems, but deciding what
    # problems to solve."
    "gh": "The difficult thing in software, like in lots of other areas, is choosing which problems are "
    "worth working on rather than solving them.",
    # "Once, when I was about 9 or 10, my father told me I could be whatever I wanted when I grew up, so
    # long as I enjoyed it."
    "love": "As a child of nine or ten, my dad said I could choose any career as an adult, provided it was "
    "something I liked doing.",
    # "The world of startups is so unpredictable that you need to be able to modify your dreams on the fly."
    "founders": "Because the startup world is so unpredictable, founders must be able to change their "
    "ambitions as they go.",
    # "You can do what you want, but you can't want what you want."
    "want": "We are free to act on our desires, yet we have no control over what those desires are.",
}


@pytest.fixture(scope="module", params=["flat", "hnsw"])
def essay_index(request, tmp_path_factory, essay_vectors, embedder) -> VectorIndex:
    folder = tmp_path_factory.mktemp(f"faiss-{request.param}")
    idx = VectorIndex.open(folder, embedder.dim, RetrieverSettings(index_type=request.param))
    for i, (name, vecs) in enumerate(essay_vectors.items()):
        idx.add(name, vecs, {"essay": name, "half": "first" if i < 25 else "second"})
    return idx


def test_embeddings_are_normalized_float32(essay_vectors, embedder):
    vecs = np.concatenate(list(essay_vectors.values()))
    assert vecs.dtype == np.float32 and vecs.shape[1] == embedder.dim == 384
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)


def test_paraphrased_sentence_finds_its_essay_in_top_3(essay_index, embedder, essays):
    assert len(essay_index.document_ids()) == len(essays) == 49
    queries = embedder.embed(list(PARAPHRASES.values()))
    for (essay, text), q in zip(PARAPHRASES.items(), queries, strict=True):
        hits = essay_index.search(q, 3)
        assert essay in [h.document_id for h in hits], (essay, text, hits)


def test_long_chunk_is_searchable_past_the_embedder_window(essay_chunks, embedder):
    """A 512-token chunk is longer than the embedder's 256-piece window: its end still counts."""
    chunk = next(c for chunks in essay_chunks.values() for c in chunks if len(c.token_ids) >= 480)
    tail = chunk.text[-400:]
    whole, head, tail_vec = embedder.embed([chunk.text, chunk.text[:600], tail])
    # Truncation would make the whole chunk's vector that of its head; the mean of windows keeps the tail.
    assert float(whole @ tail_vec) > float(head @ tail_vec) + 0.05


def test_removed_essay_is_never_returned(tmp_path, essay_vectors, embedder):
    idx = VectorIndex.open(tmp_path, embedder.dim, RetrieverSettings())
    for name, vecs in essay_vectors.items():
        idx.add(name, vecs)
    total = len(idx)
    assert idx.remove("submarine") == len(essay_vectors["submarine"])
    assert len(idx) == total - len(essay_vectors["submarine"])
    q = embedder.embed([PARAPHRASES["submarine"]])[0]
    assert all(h.document_id != "submarine" for h in idx.search(q, 50))


def test_filter_keeps_to_its_documents_and_fills_top_k(essay_index, embedder, essay_vectors):
    q = embedder.embed([PARAPHRASES["founders"]])[0]  # "founders" is in the first half
    hits = essay_index.search(q, 6, filters={"half": "second"})
    second = set(list(essay_vectors)[25:])
    assert len(hits) == 6 and {h.document_id for h in hits} <= second
    hits = essay_index.search(q, 4, document_ids=["want", "gh"])
    assert len(hits) == 4 and {h.document_id for h in hits} <= {"want", "gh"}


def test_essay_index_survives_a_reopen(tmp_path, essay_vectors, embedder):
    settings = RetrieverSettings(index_type="hnsw")
    idx = VectorIndex.open(tmp_path, embedder.dim, settings)
    for name, vecs in essay_vectors.items():
        idx.add(name, vecs, {"essay": name})
    idx.save()
    queries = embedder.embed(list(PARAPHRASES.values()))
    before = [idx.search(q, 4) for q in queries]
    again = VectorIndex.open(tmp_path, embedder.dim, settings)
    assert [again.search(q, 4) for q in queries] == before


def test_embedder_refuses_a_model_it_cannot_find_locally(tmp_path):
    from kvfuse.retriever import Embedder

    with pytest.raises(EmbedderError, match="local files"):
        Embedder(str(tmp_path / "no-such-model"))
    with pytest.raises(EmbedderError, match="local files"):
        Embedder("no-such-org/no-such-model")  # a hub id not in the local cache: refused, never fetched


def test_embed_nothing(embedder):
    assert embedder.embed([]).shape == (0, embedder.dim)


def test_embed_counted_counts_every_word_piece_past_the_window_too(essay_chunks, embedder):
    """The usage /v1/embeddings reports: the texts' word pieces, special tokens not counted, a long text's
    every window included; the vectors are embed()'s."""
    long = next(c.text for chunks in essay_chunks.values() for c in chunks if len(c.token_ids) >= 480)
    texts = ["tide tables", long]
    vecs, tokens = embedder.embed_counted(texts)
    pieces = embedder.model.tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert tokens == sum(map(len, pieces)) and len(pieces[1]) > embedder.max_seq_length
    np.testing.assert_allclose(vecs, embedder.embed(texts), atol=1e-6)
    empty, none = embedder.embed_counted([])
    assert empty.shape == (0, embedder.dim) and none == 0


def test_embedder_serves_several_threads_at_once(embedder):
    """Questions are embedded from a thread pool while ingestion embeds chunks."""
    from concurrent.futures import ThreadPoolExecutor

    texts = list(PARAPHRASES.values())
    expected = embedder.embed(texts)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: embedder.embed([texts[i % len(texts)]]), range(24)))
    for i, vec in enumerate(results):
        np.testing.assert_allclose(vec[0], expected[i % len(texts)], atol=1e-5)
