"""The multi-document layout: short documents of distinct essays, each fact in its own document, the
retrieval order by the embedder, and `neighbours` contexts found in the corpus, never the document's own
passage."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from kvfuse.bench import multidoc, tasks

CFG = tasks.TaskConfig(n=3, docs=6, doc_tokens=200, seed=7)


@pytest.fixture(scope="module")
def corpus(tokenizer, shared_data: Path) -> multidoc.Corpus:
    return multidoc.Corpus(tokenizer, shared_data, CFG.doc_tokens)


@pytest.fixture(scope="module")
def embedder(default_embedder_path: str):
    from kvfuse.retriever import Embedder

    return Embedder(default_embedder_path)


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_corpus_cuts_each_essay_into_passages_within_the_budget(corpus, essays):
    assert len(corpus) > 300 and len(corpus.drawable) >= 40
    for (name, body) in essays:
        mine = [p for p, e in enumerate(corpus.essays) if e == name]
        joined = [s for p in mine for s in corpus.sentences[p]]
        kept = [s for s in tasks.split_sentences(body) if corpus.count(s) <= CFG.doc_tokens]
        assert joined == kept  # consecutive, nothing lost but sentences longer than a passage
        assert all(sum(corpus.counts[p]) <= CFG.doc_tokens for p in mine)
    for essay, passages in corpus.drawable.items():
        assert all(corpus.essays[p] == essay and sum(corpus.counts[p]) >= multidoc.MIN_FILL * CFG.doc_tokens
                   for p in passages)


@pytest.mark.parametrize("task", multidoc.TASKS)
def test_each_document_is_one_essays_passage_and_each_fact_sits_in_its_own_document(task, corpus, tokenizer):
    for ex in multidoc.build_examples(task, corpus, CFG, "shuffled"):
        assert ex.task == f"{task}-docs-shuffled" and len(ex.chunks) == len(ex.sources) == CFG.docs
        assert len({corpus.essays[p] for p in ex.sources}) == CFG.docs  # distinct essays
        assert len(set(ex.fact_chunks)) == len(ex.facts)  # one fact per document
        for fact, where in zip(ex.facts, ex.fact_chunks, strict=True):
            assert [d for d, c in enumerate(ex.chunks) if fact in c] == [where]
        for doc, p in zip(ex.chunks, ex.sources, strict=True):
            plain = doc
            for fact in ex.facts:
                plain = plain.replace(" " + fact, "").replace(fact + " ", "").replace(fact, "")
            assert corpus.texts[p].startswith(plain)  # the passage, its tail dropped for the facts' room
            assert len(_tokens(tokenizer, doc)) <= CFG.doc_tokens + 8
            assert len(_tokens(tokenizer, doc)) >= 0.5 * CFG.doc_tokens
        text = " ".join(ex.chunks)
        if task == "multivalue":
            key = re.search(r"numbers for ([\w-]+) mentioned", ex.question).group(1)
            found = re.findall(rf"magic numbers for {re.escape(key)} is: (\d+)\.", text)
            assert sorted(found) == sorted(ex.answers)
        else:
            key = re.search(r"for ([\w-]+) mentioned", ex.question).group(1)
            pairs = dict(re.findall(r"The special magic number for ([\w-]+) is: (\d+)\.", text))
            assert ex.answers == [pairs[key]] and key in ex.answer_prefix
            assert len(pairs) == (tasks.MULTIKEY_NEEDLES if task == "multikey" else 1)


def test_retrieval_order_puts_the_documents_by_cosine_with_the_question(corpus, embedder):
    cfg = tasks.TaskConfig(n=2, docs=5, doc_tokens=200, seed=3)
    shuffled = multidoc.build_examples("multikey", corpus, cfg, "shuffled")
    ranked = multidoc.build_examples("multikey", corpus, cfg, "retrieval", embedder.embed)
    for a, b in zip(shuffled, ranked, strict=True):
        assert b.task == "multikey-docs" and b.id.startswith("multikey-docs-3-")
        assert sorted(b.sources) == sorted(a.sources) and b.facts == a.facts  # the same draw, reordered
        for doc, p in zip(b.chunks, b.sources, strict=True):
            assert doc == a.chunks[a.sources.index(p)]
        for fact, where in zip(b.facts, b.fact_chunks, strict=True):
            assert fact in b.chunks[where]
        vecs = embedder.embed([b.question, *b.chunks])
        sims = vecs[1:] @ vecs[0]
        assert all(x >= y - 1e-6 for x, y in zip(sims, sims[1:], strict=False))


def test_best_last_is_the_retrieval_order_reversed_and_names_follow_their_documents(corpus, embedder):
    from kvfuse.bench.fidelity import neutral_swap

    cfg = tasks.TaskConfig(n=2, docs=6, doc_tokens=200, seed=3)  # 4 facts: two documents hold none
    ranked = multidoc.build_examples("multikey", corpus, cfg, "retrieval", embedder.embed)
    last = multidoc.build_examples("multikey", corpus, cfg, "best-last", embedder.embed)
    for a, b in zip(ranked, last, strict=True):
        assert b.task == "multikey-docs-best-last" and b.chunks == a.chunks[::-1] and b.titles == a.titles[::-1]
        assert b.titles == [corpus.essays[p] for p in b.sources] and b.names() == b.titles
        for fact, where in zip(b.facts, b.fact_chunks, strict=True):
            assert fact in b.chunks[where]
        # the floor swaps two documents that hold no fact, the same two every time
        order = neutral_swap(b)
        moved = [i for i, j in enumerate(order) if i != j]
        assert len(moved) == 2 and not set(moved) & set(b.fact_chunks) and order == neutral_swap(b)
    # where every document holds a fact, or the facts are not known, there is no neutral swap
    ex = ranked[0]
    import dataclasses

    assert neutral_swap(dataclasses.replace(ex, fact_chunks=list(range(len(ex.chunks))))) is None
    assert neutral_swap(dataclasses.replace(ex, fact_chunks=[])) is None


def test_retrieval_order_ties_go_to_the_earlier_document():
    q = np.array([1.0, 0.0], dtype=np.float32)
    docs = np.array([[0.0, 1.0], [1.0, 0.0], [0.6, 0.8], [1.0, 0.0]], dtype=np.float32)
    assert multidoc.retrieval_order(q, docs) == [1, 3, 2, 0]


def test_examples_are_seeded_and_the_order_does_not_change_the_draw(corpus):
    a = multidoc.build_examples("needle", corpus, CFG, "shuffled")
    b = multidoc.build_examples("needle", corpus, CFG, "shuffled")
    c = multidoc.build_examples("needle", corpus, tasks.TaskConfig(n=3, docs=6, doc_tokens=200, seed=8), "shuffled")
    assert [e.chunks for e in a] == [e.chunks for e in b]
    assert [e.answers for e in a] != [e.answers for e in c]
    with pytest.raises(ValueError, match="vartrack"):
        multidoc.draw("vartrack", corpus, CFG, 0, "shuffled")
    with pytest.raises(ValueError, match="embedder"):
        multidoc.build_examples("needle", corpus, CFG, "retrieval")


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory, essays, tokenizer) -> multidoc.Corpus:
    """A small corpus (ten essay openings): the embedding of every passage stays quick."""
    root = tmp_path_factory.mktemp("small")
    folder = root / "paul_graham_essays"
    folder.mkdir()
    for name, body in essays[:10]:
        (folder / f"{name}.txt").write_text(body[:2500], encoding="utf-8")
    return multidoc.Corpus(tokenizer, root, 120)


def test_neighbour_contexts_come_from_the_corpus_and_never_from_the_documents_own_passage(
        small, tokenizer, embedder):
    cfg = tasks.TaskConfig(n=1, docs=4, doc_tokens=120, seed=1)
    ex = multidoc.build_examples("multikey", small, cfg, "shuffled")[0]
    ids = [_tokens(tokenizer, c) for c in ex.chunks]
    vecs = embedder.embed(ex.chunks)
    contexts = small.neighbour_contexts(ex.sources, ids, vecs, embedder.embed, lambda t: _tokens(tokenizer, t),
                                        2, 1024)
    pool = small.vectors(embedder.embed)
    for i, ctx in enumerate(contexts):
        # the two most similar candidates: the example's other documents and the passages it did not use
        cands = [(float(vecs[i] @ vecs[j]), ids[j]) for j in range(len(ids)) if j != i]
        cands += [(float(vecs[i] @ pool[p]), small.token_ids(p, lambda t: _tokens(tokenizer, t)))
                  for p in range(len(small)) if p not in ex.sources]
        best = sorted(cands, key=lambda c: -c[0])[:2]
        assert ctx == best[1][1] + best[0][1]  # least similar first: the closest sits next to the chunk
        own = small.token_ids(ex.sources[i], lambda t: _tokens(tokenizer, t))
        assert not any(ctx[k:k + len(own)] == own for k in range(len(ctx) - len(own) + 1))
    # a budget cuts the joined context to its last tokens
    short = small.neighbour_contexts(ex.sources, ids, vecs, embedder.embed, lambda t: _tokens(tokenizer, t), 2, 50)
    assert short == [c[-50:] for c in contexts]


@pytest.mark.slow
def test_the_benchmark_picks_contexts_as_the_service_would(small, tokenizer, shared_data: Path,
                                                          default_llm_path: str) -> None:
    """Each multi-document document is one chunk: `document` gives it nothing, `document_or_neighbours`
    its neighbours; on the single haystack the latter is `document` but for the first chunk."""
    from kvfuse.bench.engine_backend import EngineBackend
    from kvfuse.config import Settings
    from kvfuse.fusion.chunk_context import document_contexts

    backend = EngineBackend(Settings(model_cache_dir=Path(default_llm_path).parent), max_tokens=4)
    ex = multidoc.build_examples("needle", small, tasks.TaskConfig(n=1, docs=3, doc_tokens=120, seed=2),
                                 "shuffled", embed=backend.embedder().embed)[0]
    ids = [_tokens(tokenizer, c) for c in ex.chunks]
    by_mode = {}
    for mode in ("document", "neighbours", "document_or_neighbours"):
        backend.context_mode = mode
        by_mode[mode] = backend.contexts(ex, [], ids)
    assert by_mode["document"] == [[], [], []]
    assert by_mode["document_or_neighbours"] == by_mode["neighbours"] and all(by_mode["neighbours"])

    hay = tasks.build_examples("needle", tokenizer, shared_data, tasks.TaskConfig(n=1, docs=3, doc_tokens=64, seed=2))[0]
    ids = [_tokens(tokenizer, c) for c in hay.chunks]
    backend.context_mode = "neighbours"
    first = backend.contexts(hay, [], ids)[0]
    backend.context_mode = "document_or_neighbours"
    mixed = backend.contexts(hay, [], ids)
    assert first and mixed == [first, *document_contexts(ids, backend.context_tokens)[1:]]


@pytest.mark.slow
def test_the_benchmark_starts_every_context_of_a_bos_adding_model_with_its_bos(
        tmp_path_factory: pytest.TempPathFactory, essays, settings_factory, gemma3_path: Path) -> None:
    """Gemma 3's tokenizer adds a BOS: every mode's context starts with it once (`none` is it alone), as
    the service's do, and `none` caches each chunk after it: its slice of a prefill of BOS + chunk."""
    import torch

    from kvfuse.bench.engine_backend import EngineBackend
    from kvfuse.fusion.chunk_context import MODES

    backend = EngineBackend(settings_factory(redis_url="", model={"llm": str(gemma3_path)}), max_tokens=4)
    tok, budget = backend.tokenizer, backend.context_tokens
    bos = tok.bos_token_id
    root = tmp_path_factory.mktemp("small-gemma")
    (root / "paul_graham_essays").mkdir()
    for name, body in essays[:10]:
        (root / "paul_graham_essays" / f"{name}.txt").write_text(body[:2500], encoding="utf-8")
    corpus = multidoc.Corpus(tok, root, 120)
    ex = multidoc.build_examples("needle", corpus, tasks.TaskConfig(n=1, docs=3, doc_tokens=120, seed=2),
                                 "shuffled", embed=backend.embedder().embed)[0]
    prefix_ids, _ = backend.question_ids(ex)
    ids = backend.chunk_ids(ex)
    assert prefix_ids[0] == bos
    for mode in MODES:
        backend.context_mode = mode
        raw, got = backend._mode_contexts(ex, prefix_ids, ids), backend.contexts(ex, prefix_ids, ids)
        assert all(c[0] == bos and c.count(bos) == 1 for c in got), (mode, got)
        assert got == [r if r[:1] == [bos] else [bos] + r[-(budget - 1):] for r in raw], mode
        if mode in ("none", "document", "sink"):  # each document is one chunk: nothing before it
            assert got == [[bos]] * len(ids), mode
        if mode == "prefix":
            assert got == [prefix_ids] * len(ids)
    backend.context_mode = "none"
    _, chunks, _ = backend.prepare(ex)
    for ckv, c in zip(chunks, ids, strict=True):
        want = backend.engine.precompute_after([bos], c)
        assert ckv.after_context and torch.equal(ckv.k, want.k) and torch.equal(ckv.v, want.v)
