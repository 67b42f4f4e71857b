"""KeywordIndex on real bm25s: BM25 scores as bm25s gives them in every segment, adds/overwrites/removes,
merges (also while other threads change and search), persistence and its failure modes, drift."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from kvfuse.config import RetrieverSettings
from kvfuse.retriever import IndexLoadError
from kvfuse.retriever.keyword_index import KeywordIndex
from kvfuse.retriever.keyword_segments import analyze

DOCS = {
    "harbor": ["The lighthouse keeper counted ships in the harbor every night.",
               "Fog rolled over the harbor; the keeper lit the lamp early."],
    "orchard": ["Apple trees in the orchard bloom in spring.", "Pears ripen late; the orchard smells of cider."],
    "violin": ["She tuned the violin before the concert.", "The concert hall was silent until the violin began.",
               "Rosin dust covered the violin strings."],
    "glacier": ["The glacier retreats a little more each summer.", "Meltwater from the glacier feeds the river."],
}


def _settings(**kw) -> RetrieverSettings:
    return RetrieverSettings(**kw)


def _filled(path, docs=DOCS, **kw) -> KeywordIndex:
    idx = KeywordIndex.open(path, _settings(**kw))
    for doc, texts in docs.items():
        idx.add(doc, texts)
    return idx


def _pairs(hits) -> list[tuple[str, int]]:
    return [(h.document_id, h.chunk_index) for h in hits]


def _bm25s_reference(docs: dict[str, list[str]], query: str, k: int) -> list[tuple[tuple[str, int], float]]:
    """bm25s's own high-level API over the same analyzed chunks: the scores every segment must give."""
    import bm25s

    rows = [(d, i) for d, texts in docs.items() for i in range(len(texts))]
    corpus = [analyze(t) for texts in docs.values() for t in texts]
    ref = bm25s.BM25(method="lucene")
    ref.index(corpus, show_progress=False)
    terms = list(dict.fromkeys(t for t in analyze(query) if t in ref.vocab_dict))
    scores = ref.get_scores(terms)
    order = np.argsort(-scores, kind="stable")[:k]
    return [(rows[i], float(scores[i])) for i in order if scores[i] > 0]


@pytest.mark.parametrize("segment", ["fresh", "base"])
def test_scores_are_bm25s_scores_in_either_segment(tmp_path, segment):
    idx = _filled(tmp_path / "kw", keyword_merge_min_chunks=1000)
    assert idx.segments()["fresh"] == 9 and idx.segments()["base"] == 0  # below the floor: nothing merged
    if segment == "base":
        idx.merge()
        assert idx.segments() == {"base": 9, "fresh": 0, "dead": 0, "terms": idx.segments()["terms"]}
    for query in ("violin concert", "harbor keeper lamp", "orchard cider apple", "glacier river summer"):
        hits = idx.search(query, 5)
        ref = _bm25s_reference(DOCS, query, 5)
        assert _pairs(hits) == [r for r, _ in ref]
        np.testing.assert_allclose([h.score for h in hits], [s for _, s in ref], rtol=1e-5)


def test_only_matching_chunks_come_back_and_stopwords_match_nothing(tmp_path):
    idx = _filled(tmp_path / "kw")
    hits = idx.search("Rosin", 10)
    assert _pairs(hits) == [("violin", 2)] and hits[0].score > 0
    assert KeywordIndex.terms("Is it the, or that?") == [] and idx.search("Is it the, or that?", 4) == []
    assert idx.search("zeppelin", 4) == []  # a term no chunk has
    assert KeywordIndex.terms("Violin, VIOLIN and the violins") == ["violin", "violins"]  # no stemming
    assert {h.document_id for h in idx.search("the orchard and the harbor", 10)} == {"orchard", "harbor"}
    with pytest.raises(ValueError, match="top_k"):
        idx.search("violin", 0)
    with pytest.raises(ValueError, match="no chunks"):
        idx.add("empty", [])


def test_document_ids_restrict_the_search(tmp_path):
    idx = _filled(tmp_path / "kw")
    assert {h.document_id for h in idx.search("harbor orchard violin", 10, document_ids=["orchard"])} == {"orchard"}
    assert idx.search("violin", 4, document_ids=[]) == [] and idx.search("violin", 4, document_ids=["nope"]) == []


@pytest.mark.parametrize("merge", [False, True])
def test_overwrite_and_remove_leave_nothing_behind(tmp_path, merge):
    idx = _filled(tmp_path / "kw", keyword_merge_min_chunks=0 if merge else 1000, keyword_merge_ratio=0.2)
    idx.add("violin", ["A cello, not the other instrument, now."])  # overwrite: one chunk instead of three
    assert idx.chunk_count("violin") == 1 and len(idx) == 7
    assert idx.search("rosin concert", 10) == []
    assert _pairs(idx.search("cello", 3)) == [("violin", 0)]
    assert idx.remove("glacier") == 2 and idx.remove("glacier") == 0
    assert idx.search("glacier meltwater", 10) == [] and len(idx) == 5
    segments = idx.segments()
    assert (segments["dead"] == 0) if merge else (segments["dead"] == 5)  # merged away, or masked until then
    # The chunks found are those of an index built from the live documents alone (dead rows still count
    # in the statistics until a merge, so the scores match exactly only after one).
    live = {"harbor": DOCS["harbor"], "orchard": DOCS["orchard"], "violin": ["A cello, not the other instrument, now."]}
    for query in ("harbor keeper", "orchard cello"):
        ref = _bm25s_reference(live, query, 5)
        hits = idx.search(query, 5)
        assert sorted(_pairs(hits)) == sorted(r for r, _ in ref)
        if merge:
            assert _pairs(hits) == [r for r, _ in ref]
            np.testing.assert_allclose([h.score for h in hits], [s for _, s in ref], rtol=1e-5)


def test_index_survives_a_reopen_and_other_bm25_parameters_rebuild_the_base(tmp_path):
    folder = tmp_path / "kw"
    idx = _filled(folder, keyword_merge_min_chunks=4)  # some rows in the base, later ones fresh
    idx.add("extra", ["The violin and the glacier share nothing but this sentence."])
    idx.remove("orchard")
    idx.save()
    queries = ["violin glacier", "harbor keeper", "orchard", "meltwater river"]
    before = [idx.search(q, 6) for q in queries]
    again = KeywordIndex.open(folder, _settings(keyword_merge_min_chunks=4))
    assert [again.search(q, 6) for q in queries] == before
    assert again.segments() == idx.segments() and again.document_ids() == idx.document_ids()
    other = KeywordIndex.open(folder, _settings(bm25_k1=0.9, bm25_b=0.4))
    assert other.segments()["fresh"] == 0 and other.segments()["dead"] == 0  # rebuilt from the saved rows
    assert _pairs(other.search("violin glacier", 6))[0] == ("extra", 0)
    assert [p.name for p in folder.glob("keyword-*.npz")] == [f"keyword-{again._generation:08d}.npz"]


def test_torn_or_corrupt_files_are_detected(tmp_path):
    folder = tmp_path / "kw"
    _filled(folder).save()
    sidecar = folder / "keyword.json"
    good = sidecar.read_bytes()
    (data,) = folder.glob("keyword-*.npz")
    good_data = data.read_bytes()

    sidecar.write_bytes(good[: len(good) // 2])
    with pytest.raises(IndexLoadError, match="torn or corrupt sidecar"):
        KeywordIndex.open(folder, _settings())
    edited = json.loads(good)
    edited["body"]["documents"]["violin"][1] = 2
    sidecar.write_text(json.dumps(edited))
    with pytest.raises(IndexLoadError, match="checksum"):
        KeywordIndex.open(folder, _settings())
    sidecar.write_bytes(good)
    data.write_bytes(good_data[:-10])
    with pytest.raises(IndexLoadError, match="does not match"):
        KeywordIndex.open(folder, _settings())
    data.unlink()
    with pytest.raises(IndexLoadError, match="missing"):
        KeywordIndex.open(folder, _settings())
    data.write_bytes(good_data)
    assert len(KeywordIndex.open(folder, _settings())) == 9


def test_a_sidecar_whose_rows_disagree_is_refused_even_when_sealed(tmp_path):
    """A consistent-looking pair that names rows the data file lacks (a bug, not a torn write)."""
    from kvfuse.retriever.keyword_files import STEM
    from kvfuse.retriever.sealed import load_pair, save_pair

    folder = tmp_path / "kw"
    _filled(folder).save()
    body, blob = load_pair(folder, STEM)
    body["documents"]["violin"] = [7, 5]
    save_pair(folder, STEM, "npz", blob, body, body["generation"])
    with pytest.raises(IndexLoadError, match="disagree"):
        KeywordIndex.open(folder, _settings())


def test_check_reports_drift_and_rebuild_restores(tmp_path):
    idx = _filled(tmp_path / "kw")
    assert idx.check({d: len(t) for d, t in DOCS.items()}).ok
    report = idx.check({"harbor": 2, "orchard": 3, "stored-only": 1})
    assert report.missing == ["stored-only"] and report.extra == ["glacier", "violin"]
    assert report.mismatched == {"orchard": (3, 2)}
    assert idx.rebuild([("a", ["alpha beta"]), ("b", ["beta gamma", "gamma delta"])]) == 2
    assert idx.check({"a": 1, "b": 2}).ok and idx.segments()["fresh"] == 0
    assert _pairs(idx.search("delta", 3)) == [("b", 1)]
    with pytest.raises(ValueError, match="twice"):
        idx.rebuild([("a", ["x"]), ("a", ["y"])])


def test_merges_while_other_threads_change_and_search(tmp_path, essay_chunks):
    """Merges run outside the lock: searches answer throughout, and a change made during a merge's build
    is carried into the merged index (the end state equals one built from the final documents)."""
    texts = {name: [c.text for c in chunks] for name, chunks in list(essay_chunks.items())[:12]}
    idx = KeywordIndex.open(tmp_path / "kw", _settings(keyword_merge_min_chunks=8, keyword_merge_ratio=0.05))
    for name in list(texts)[:6]:
        idx.add(name, texts[name])
    errors: list[BaseException] = []
    stop = threading.Event()

    def searcher() -> None:
        try:
            while not stop.is_set():
                assert len(idx.search("startup founders investors", 5)) == 5
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    def merger() -> None:
        try:
            while not stop.is_set():
                idx.merge()
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=searcher), threading.Thread(target=merger)]
    for t in threads:
        t.start()
    final = dict(list(texts.items())[:6])
    for i, name in enumerate(list(texts)[6:]):
        idx.add(name, texts[name])
        final[name] = texts[name]
        gone = list(texts)[i]
        idx.remove(gone)
        final.pop(gone)
    idx.add(list(final)[0], ["a replacement text about zeppelins"])
    final[list(final)[0]] = ["a replacement text about zeppelins"]
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert idx.check({d: len(t) for d, t in final.items()}).ok
    idx.merge()
    for query in ("startup founders investors", "zeppelins", "essay writing"):
        hits = idx.search(query, 8)
        ref = _bm25s_reference(final, query, 8)
        assert _pairs(hits) == [r for r, _ in ref]
        np.testing.assert_allclose([h.score for h in hits], [s for _, s in ref], rtol=1e-5)
