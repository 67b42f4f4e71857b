"""Reciprocal rank fusion: the fused order and scores by the formula, ranks kept per list, determinism;
and on real essays, hybrid retrieval finds what either list alone misses."""

from __future__ import annotations

import pytest

from kvfuse.config import RetrieverSettings
from kvfuse.retriever import Hit, VectorIndex
from kvfuse.retriever.hybrid import ranked, reciprocal_rank_fusion
from kvfuse.retriever.keyword_index import KeywordIndex


def _hits(*pairs: tuple[str, int]) -> list[Hit]:
    return [Hit(d, c, 1.0 - i / 10) for i, (d, c) in enumerate(pairs)]


def test_fused_scores_follow_the_formula_and_keep_each_rank():
    dense = _hits(("a", 0), ("b", 0), ("c", 0))
    keyword = _hits(("c", 0), ("d", 1), ("a", 0))
    fused = reciprocal_rank_fusion(dense, keyword, k=60, top_k=10)
    by = {(h.document_id, h.chunk_index): h for h in fused}
    assert by[("a", 0)].score == pytest.approx(1 / 61 + 1 / 63)
    assert by[("c", 0)].score == pytest.approx(1 / 63 + 1 / 61)
    assert by[("b", 0)].score == pytest.approx(1 / 62) and by[("d", 1)].score == pytest.approx(1 / 62)
    assert (by[("a", 0)].dense_rank, by[("a", 0)].keyword_rank) == (1, 3)
    assert (by[("d", 1)].dense_rank, by[("d", 1)].keyword_rank) == (None, 2)
    # a and c tie on score and best rank (1): the dense order decides; b and d tie too: same rule.
    assert [(h.document_id, h.chunk_index) for h in fused] == [("a", 0), ("c", 0), ("b", 0), ("d", 1)]
    assert len(reciprocal_rank_fusion(dense, keyword, k=60, top_k=2)) == 2


def test_a_small_k_favours_the_head_of_one_list_over_agreement_low_in_both():
    dense = _hits(("top", 0), ("x", 0), ("y", 0), ("both", 0))
    keyword = _hits(("z", 0), ("w", 0), ("v", 0), ("both", 0))
    assert reciprocal_rank_fusion(dense, keyword, k=1, top_k=1)[0].document_id == "top"
    assert reciprocal_rank_fusion(dense, keyword, k=60, top_k=1)[0].document_id == "both"


def test_one_empty_list_keeps_the_others_order():
    dense = _hits(("a", 0), ("b", 1))
    assert [(h.document_id, h.dense_rank, h.keyword_rank) for h in reciprocal_rank_fusion(dense, [], k=60, top_k=5)] \
        == [("a", 1, None), ("b", 2, None)]
    assert [h.keyword_rank for h in ranked(dense, "keyword")] == [1, 2]


@pytest.mark.slow
def test_hybrid_finds_a_rare_name_and_a_paraphrase_on_real_essays(tmp_path, essay_chunks, essay_vectors, embedder):
    """A query that names a rare word the embedder does not know well, and one that only paraphrases:
    keyword search finds the first, dense the second, hybrid both in its top 3."""
    dense = VectorIndex.open(tmp_path / "faiss", embedder.dim, RetrieverSettings())
    keyword = KeywordIndex.open(tmp_path / "kw", RetrieverSettings())
    for name, chunks in essay_chunks.items():
        dense.add(name, essay_vectors[name])
        keyword.add(name, [c.text for c in chunks])
    rare = "Bronnie Ware"  # the palliative care nurse in "todo"
    paraphrase = ("For each word that survives into the finished essay, I write roughly three or four that get "
                  "cut.")  # "laundry"
    for query, essay in ((rare, "todo"), (paraphrase, "laundry")):
        vec = embedder.embed([query])[0]
        fused = reciprocal_rank_fusion(dense.search(vec, 50), keyword.search(query, 50), k=60, top_k=3)
        assert essay in [h.document_id for h in fused], (query, fused)
    assert keyword.search(rare, 1)[0].document_id == "todo"


def test_search_runs_each_mode_over_the_same_selection(tmp_path, unit_vectors):
    from kvfuse.retriever.hybrid import search

    texts = {"a": ["red apples and pears", "green grapes"], "b": ["blue whales swim", "grey whales sing"]}
    vecs = {"a": unit_vectors(2, 16, seed=1), "b": unit_vectors(2, 16, seed=2)}
    dense = VectorIndex.open(tmp_path / "faiss", 16, RetrieverSettings())
    keyword = KeywordIndex.open(tmp_path / "kw", RetrieverSettings())
    for d in texts:
        dense.add(d, vecs[d])
        keyword.add(d, texts[d])
    embedded: list[str] = []

    def embed(q: str):
        embedded.append(q)
        return vecs["b"][1]  # the question "means" b's second chunk

    def run(mode: str, **kw):
        return search(mode, "whales", 4, embed=embed, dense=dense, keyword=keyword, **kw)

    hits = run("keyword")
    assert embedded == [] and [(h.document_id, h.chunk_index, h.keyword_rank) for h in hits] == [
        ("b", 0, 1), ("b", 1, 2)]  # equal BM25: row order
    dense_hits = run("dense")
    assert embedded == ["whales"] and (dense_hits[0].document_id, dense_hits[0].chunk_index) == ("b", 1)
    assert [h.dense_rank for h in dense_hits] == [1, 2, 3, 4] and {h.keyword_rank for h in dense_hits} == {None}
    fused = run("hybrid", candidates=2)
    assert (fused[0].document_id, fused[0].chunk_index, fused[0].dense_rank, fused[0].keyword_rank) == ("b", 1, 1, 2)
    assert len(fused) == 4  # each list read to max(top_k, candidates) = 4: all 4 chunks, 2 of them in both
    assert sum(h.keyword_rank is not None for h in fused) == 2
    assert run("hybrid", document_ids=["a"]) and all(h.document_id == "a" for h in run("hybrid", document_ids=["a"]))
    with pytest.raises(ValueError, match="unknown retrieval mode"):
        run("sparse")
