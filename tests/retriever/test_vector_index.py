"""VectorIndex mechanics on real FAISS: add/remove by document, filters, persistence, drift, both index types.

Vectors here are random unit vectors (what they mean does not matter to these mechanics); retrieval
quality on real essay embeddings is in test_retrieval.py."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from kvfuse.config import RetrieverSettings
from kvfuse.retriever import IndexLoadError, VectorIndex
from kvfuse.retriever.index_files import SIDECAR

DIM = 32
TYPES = ["flat", "hnsw"]


def _settings(index_type: str, **kw) -> RetrieverSettings:
    return RetrieverSettings(index_type=index_type, **kw)


def _corpus(unit_vectors, n_docs: int = 12, per_doc: int = 10) -> dict[str, np.ndarray]:
    return {f"doc{i:02d}": unit_vectors(per_doc, DIM, seed=i) for i in range(n_docs)}


def _filled(tmp_path: Path, index_type: str, corpus: dict[str, np.ndarray], **kw) -> VectorIndex:
    idx = VectorIndex.open(tmp_path / "faiss", DIM, _settings(index_type, **kw))
    for i, (doc, vecs) in enumerate(corpus.items()):
        idx.add(doc, vecs, {"group": "even" if i % 2 == 0 else "odd", "n": i})
    return idx


@pytest.mark.parametrize("index_type", TYPES)
def test_search_finds_each_chunk_by_its_own_vector(tmp_path, unit_vectors, index_type):
    corpus = _corpus(unit_vectors)
    idx = _filled(tmp_path, index_type, corpus)
    assert len(idx) == 120 and idx.document_ids() == set(corpus)
    for doc, vecs in corpus.items():
        for chunk in (0, 7):
            hits = idx.search(vecs[chunk], 4)
            assert (hits[0].document_id, hits[0].chunk_index) == (doc, chunk)
            assert hits[0].score == pytest.approx(1.0, abs=1e-5)
            assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
            assert len(hits) == 4


@pytest.mark.parametrize("index_type", TYPES)
def test_removal_really_removes(tmp_path, unit_vectors, index_type):
    corpus = _corpus(unit_vectors)
    idx = _filled(tmp_path, index_type, corpus)
    assert idx.remove("doc03") == 10
    assert idx.remove("doc03") == 0
    assert len(idx) == 110 and "doc03" not in idx.document_ids()
    for vec in corpus["doc03"]:
        hits = idx.search(vec, 20)
        assert len(hits) == 20 and all(h.document_id != "doc03" for h in hits)
    assert idx.search(corpus["doc03"][0], 4, document_ids=["doc03"]) == []
    # Everything else still answers, with the right chunk indices.
    hits = idx.search(corpus["doc04"][5], 1)
    assert (hits[0].document_id, hits[0].chunk_index) == ("doc04", 5)
    # Asking for more than exists gives exactly what is left.
    assert len(idx.search(corpus["doc04"][0], 500)) == 110


@pytest.mark.parametrize("index_type", TYPES)
def test_filters_never_return_another_document_and_still_fill_top_k(tmp_path, unit_vectors, index_type):
    corpus = _corpus(unit_vectors)
    idx = _filled(tmp_path, index_type, corpus)
    query = corpus["doc00"][0]  # its nearest chunks are in doc00, which the filters below exclude
    hits = idx.search(query, 8, document_ids=["doc05", "doc07"])
    assert len(hits) == 8 and {h.document_id for h in hits} <= {"doc05", "doc07"}
    expected = _exact(corpus, ["doc05", "doc07"], query, 8)
    assert [(h.document_id, h.chunk_index) for h in hits] == expected

    hits = idx.search(query, 10, filters={"group": "odd"})
    odd = [d for i, d in enumerate(corpus) if i % 2 == 1]
    assert len(hits) == 10 and {h.document_id for h in hits} <= set(odd)
    assert [(h.document_id, h.chunk_index) for h in hits] == _exact(corpus, odd, query, 10)

    # Both restrictions at once; metadata equality on several keys; no match; unknown ids.
    hits = idx.search(query, 4, document_ids=["doc05", "doc06"], filters={"group": "odd"})
    assert len(hits) == 4 and {h.document_id for h in hits} == {"doc05"}
    assert {h.document_id for h in idx.search(query, 4, filters={"group": "odd", "n": 9})} == {"doc09"}
    assert idx.search(query, 4, filters={"group": "none"}) == []
    assert idx.search(query, 4, filters={"missing-key": 1}) == []
    assert idx.search(query, 4, document_ids=[]) == []
    assert idx.search(query, 4, document_ids=["nope"]) == []
    # A one-document filter asking for more chunks than it has gets all of them.
    assert len(idx.search(query, 50, document_ids=["doc02"])) == 10


def _exact(corpus: dict[str, np.ndarray], docs: list[str], query: np.ndarray, k: int) -> list[tuple[str, int]]:
    scored = [(float(v @ query), d, i) for d in docs for i, v in enumerate(corpus[d])]
    scored.sort(key=lambda t: -t[0])
    return [(d, i) for _, d, i in scored[:k]]


@pytest.mark.parametrize("index_type", TYPES)
def test_index_survives_a_reopen(tmp_path, unit_vectors, index_type):
    corpus = _corpus(unit_vectors)
    idx = _filled(tmp_path, index_type, corpus)
    idx.remove("doc01")
    idx.save()
    queries = unit_vectors(5, DIM, seed=99)
    before = [idx.search(q, 6) for q in queries] + [idx.search(queries[0], 6, filters={"group": "even"})]

    again = VectorIndex.open(tmp_path / "faiss", DIM, _settings(index_type))
    after = [again.search(q, 6) for q in queries] + [again.search(queries[0], 6, filters={"group": "even"})]
    assert after == before
    assert len(again) == len(idx) == 110 and again.document_ids() == idx.document_ids()
    assert again.metadata("doc02") == {"group": "even", "n": 2}
    # New ids never collide with saved ones after a reopen.
    again.add("new", unit_vectors(3, DIM, seed=500))
    assert again.search(unit_vectors(3, DIM, seed=500)[2], 1)[0].chunk_index == 2
    assert again.search(corpus["doc11"][9], 1)[0].document_id == "doc11"
    # One generation of index file on disk: older ones are cleaned up.
    again.save()
    assert len(list((tmp_path / "faiss").glob("index-*.faiss"))) == 1


def test_opening_a_missing_directory_gives_an_empty_index(tmp_path):
    idx = VectorIndex.open(tmp_path / "nothing-here", DIM, _settings("flat"))
    assert len(idx) == 0 and idx.search(np.ones(DIM, dtype=np.float32) / DIM**0.5, 4) == []


def test_torn_or_corrupt_files_are_detected(tmp_path, unit_vectors):
    folder = tmp_path / "faiss"
    idx = _filled(tmp_path, "flat", _corpus(unit_vectors))
    idx.save()
    sidecar = folder / SIDECAR
    good = sidecar.read_bytes()
    (index_file,) = folder.glob("index-*.faiss")
    good_index = index_file.read_bytes()

    def reopen() -> VectorIndex:
        return VectorIndex.open(folder, DIM, _settings("flat"))

    sidecar.write_bytes(good[: len(good) // 2])  # truncated sidecar
    with pytest.raises(IndexLoadError, match="torn or corrupt sidecar"):
        reopen()

    doc = json.loads(good)
    doc["body"]["documents"]["doc00"]["count"] = 9  # edited without its checksum
    sidecar.write_text(json.dumps(doc))
    with pytest.raises(IndexLoadError, match="checksum"):
        reopen()

    sidecar.write_bytes(good)
    index_file.write_bytes(good_index[:-100])  # index file of another size than the sidecar recorded
    with pytest.raises(IndexLoadError, match="does not match"):
        reopen()

    flipped = bytearray(good_index)
    flipped[len(flipped) // 2] ^= 0xFF  # same size, other bytes
    index_file.write_bytes(bytes(flipped))
    with pytest.raises(IndexLoadError, match="does not match"):
        reopen()

    index_file.unlink()
    with pytest.raises(IndexLoadError, match="missing"):
        reopen()

    index_file.write_bytes(good_index)
    assert len(reopen()) == 120


def test_a_save_interrupted_before_its_sidecar_keeps_the_previous_pair(tmp_path, unit_vectors):
    """A crash after writing the new index file but before the sidecar rename: the old pair still loads."""
    folder = tmp_path / "faiss"
    idx = _filled(tmp_path, "flat", _corpus(unit_vectors))
    idx.save()
    old_sidecar = (folder / SIDECAR).read_bytes()
    idx.remove("doc00")
    idx.save()
    (folder / SIDECAR).write_bytes(old_sidecar)  # as if the second sidecar never landed
    with pytest.raises(IndexLoadError):
        VectorIndex.open(folder, DIM, _settings("flat"))  # its index file was already cleaned up: detected
    # The real interrupted save leaves the old index file beside the new one; the old sidecar names it.
    idx2 = _filled(tmp_path / "b", "flat", _corpus(unit_vectors))
    idx2.save()
    folder2 = tmp_path / "b" / "faiss"
    (folder2 / "index-00000002.faiss").write_bytes(b"new generation, sidecar not yet renamed")
    assert len(VectorIndex.open(folder2, DIM, _settings("flat"))) == 120


def test_other_dimension_is_refused(tmp_path, unit_vectors):
    idx = _filled(tmp_path, "flat", _corpus(unit_vectors, n_docs=2))
    idx.save()
    with pytest.raises(IndexLoadError, match="dimension 32"):
        VectorIndex.open(tmp_path / "faiss", 64, _settings("flat"))


@pytest.mark.parametrize(("saved", "configured"), [("flat", "hnsw"), ("hnsw", "flat")])
def test_saved_index_of_the_other_type_is_converted(tmp_path, unit_vectors, saved, configured):
    corpus = _corpus(unit_vectors)
    idx = _filled(tmp_path, saved, corpus)
    idx.remove("doc02")
    idx.save()
    again = VectorIndex.open(tmp_path / "faiss", DIM, _settings(configured))
    assert len(again) == 110 and "doc02" not in again.document_ids()
    hits = again.search(corpus["doc06"][3], 1)
    assert (hits[0].document_id, hits[0].chunk_index) == ("doc06", 3)
    again.save()
    assert json.loads((tmp_path / "faiss" / SIDECAR).read_text())["body"]["index_type"] == configured


def test_hnsw_tombstones_are_compacted(tmp_path, unit_vectors):
    corpus = _corpus(unit_vectors)
    idx = _filled(tmp_path, "hnsw", corpus, hnsw_compact_ratio=0.25)
    idx.remove("doc00")
    idx.remove("doc01")
    assert idx._state.dead == 20 and idx._state.index.ntotal == 120  # skipped, not yet rebuilt
    idx.remove("doc02")
    idx.remove("doc03")  # 40 of 120 > 25 %: rebuilt without them
    assert idx._state.dead == 0 and idx._state.index.ntotal == 80 and len(idx) == 80
    for doc in ("doc04", "doc11"):
        hits = idx.search(corpus[doc][9], 1)
        assert (hits[0].document_id, hits[0].chunk_index) == (doc, 9)
    assert all(h.document_id not in {"doc00", "doc01", "doc02", "doc03"} for h in idx.search(corpus["doc00"][0], 80))


def test_hnsw_narrow_filter_still_fills_top_k(tmp_path, unit_vectors):
    """A filter allowing a few vectors among many: the graph walk may not reach them all, exact fallback does."""
    big = {f"d{i}": unit_vectors(50, DIM, seed=1000 + i) for i in range(40)}
    idx = VectorIndex.open(tmp_path / "faiss", DIM, _settings("hnsw", hnsw_ef_search=8, hnsw_ef_construction=40))
    for doc, vecs in big.items():
        idx.add(doc, vecs)
    query = big["d0"][0]
    hits = idx.search(query, 40, document_ids=["d17"])
    assert len(hits) == 40 and {h.document_id for h in hits} == {"d17"}
    assert [(h.document_id, h.chunk_index) for h in hits] == _exact(big, ["d17"], query, 40)


def test_readding_a_document_replaces_it(tmp_path, unit_vectors):
    idx = _filled(tmp_path, "flat", _corpus(unit_vectors, n_docs=3))
    new = unit_vectors(4, DIM, seed=77)
    idx.add("doc01", new, {"v": 2})
    assert len(idx) == 24 and idx.chunk_count("doc01") == 4 and idx.metadata("doc01") == {"v": 2}
    assert idx.search(new[3], 1)[0].chunk_index == 3


def test_check_reports_drift_and_rebuild_restores(tmp_path, unit_vectors):
    corpus = _corpus(unit_vectors, n_docs=4)
    idx = _filled(tmp_path, "flat", corpus)
    assert idx.check({d: 10 for d in corpus}).ok
    report = idx.check({"doc00": 10, "doc01": 9, "doc02": 10, "stored-only": 3})
    assert not report.ok
    assert report.missing == ["stored-only"] and report.extra == ["doc03"]
    assert report.mismatched == {"doc01": (9, 10)}

    fresh = {"a": unit_vectors(3, DIM, seed=5), "b": unit_vectors(2, DIM, seed=6)}
    assert idx.rebuild((d, v, {"k": d}) for d, v in fresh.items()) == 2
    assert idx.check({"a": 3, "b": 2}).ok and len(idx) == 5
    assert idx.search(fresh["b"][1], 1, filters={"k": "b"})[0].chunk_index == 1
    idx.save()
    assert VectorIndex.open(tmp_path / "faiss", DIM, _settings("flat")).check({"a": 3, "b": 2}).ok


def test_bad_input_is_refused(tmp_path, unit_vectors):
    idx = VectorIndex.open(tmp_path / "faiss", DIM, _settings("flat"))
    with pytest.raises(ValueError, match=r"shape \[n, 32\]"):
        idx.add("x", unit_vectors(2, 16))
    with pytest.raises(ValueError, match="no vectors"):
        idx.add("x", np.zeros((0, DIM), dtype=np.float32))
    with pytest.raises(ValueError, match="JSON"):
        idx.add("x", unit_vectors(1, DIM), {"when": object()})
    with pytest.raises(ValueError, match="dimension"):
        idx.search(np.ones(8, dtype=np.float32), 4)
    with pytest.raises(ValueError, match="top_k"):
        idx.search(unit_vectors(1, DIM)[0], 0)
    assert len(idx) == 0


@pytest.mark.parametrize("index_type", TYPES)
def test_concurrent_search_while_adding_and_removing(tmp_path, unit_vectors, index_type):
    corpus = _corpus(unit_vectors)
    idx = _filled(tmp_path, index_type, corpus)
    errors: list[BaseException] = []
    stop = threading.Event()

    def searcher(seed: int) -> None:
        q = corpus[f"doc{seed:02d}"][2]
        try:
            while not stop.is_set():
                hits = idx.search(q, 4)
                assert (hits[0].document_id, hits[0].chunk_index) == (f"doc{seed:02d}", 2)
                assert all(not h.document_id.startswith("tmp") or h.chunk_index < 5 for h in hits)
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=searcher, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for i in range(60):
        idx.add(f"tmp{i}", unit_vectors(5, DIM, seed=2000 + i))
        if i % 2:
            idx.remove(f"tmp{i - 1}")
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert len(idx) == 120 + 30 * 5


def test_a_fresh_index_saved_over_a_torn_one_replaces_it(tmp_path, unit_vectors):
    """The startup path after IndexLoadError: a new index in the same directory, rebuilt, saved."""
    folder = tmp_path / "faiss"
    _filled(tmp_path, "flat", _corpus(unit_vectors)).save()
    (folder / SIDECAR).write_bytes(b'{"torn')
    with pytest.raises(IndexLoadError):
        VectorIndex.open(folder, DIM, _settings("flat"))
    fresh = VectorIndex(folder, DIM, _settings("flat"))
    fresh.rebuild([("only", unit_vectors(3, DIM, seed=9), {"k": 1})])
    fresh.save()
    again = VectorIndex.open(folder, DIM, _settings("flat"))
    assert again.document_ids() == {"only"} and len(again) == 3
    assert [p.name for p in folder.glob("index-*.faiss")] == ["index-00000002.faiss"]


def test_vectors_of_another_embedder_are_refused(tmp_path, unit_vectors):
    folder = tmp_path / "faiss"
    idx = VectorIndex.open(folder, DIM, _settings("flat"), embedder_fingerprint="model-a")
    idx.add("d", unit_vectors(2, DIM))
    idx.save()
    assert len(VectorIndex.open(folder, DIM, _settings("flat"), embedder_fingerprint="model-a")) == 2
    assert len(VectorIndex.open(folder, DIM, _settings("flat"))) == 2  # caller without a fingerprint: unchecked
    with pytest.raises(IndexLoadError, match="another embedding model"):
        VectorIndex.open(folder, DIM, _settings("flat"), embedder_fingerprint="model-b")


def test_collections_scope_searches_and_survive_a_reopen(tmp_path, unit_vectors):
    corpus = _corpus(unit_vectors, n_docs=6)
    idx = VectorIndex.open(tmp_path / "faiss", DIM, _settings("flat"))
    for i, (doc, vecs) in enumerate(corpus.items()):
        idx.add(doc, vecs, {"n": i}, collection="even" if i % 2 == 0 else "odd")
    query = corpus["doc00"][0]
    assert {h.document_id for h in idx.search(query, 30, collections=["odd"])} == {"doc01", "doc03", "doc05"}
    assert len(idx.search(query, 60, collections=["odd", "even"])) == 60
    assert idx.search(query, 4, collections=["none"]) == [] and idx.search(query, 4, collections=[]) == []
    assert idx.collections() == {"even": 3, "odd": 3}
    assert idx.select(collections=["even"], filters={"n": 2}) == ["doc02"]
    assert idx.select(document_ids=["doc03", "doc01", "doc02"], collections=["odd"]) == ["doc03", "doc01"]
    idx.add("doc01", corpus["doc01"], {"n": 1}, collection="even")  # re-adding moves it
    assert idx.collections() == {"even": 4, "odd": 2}
    idx.save()
    again = VectorIndex.open(tmp_path / "faiss", DIM, _settings("flat"))
    assert again.collections() == {"even": 4, "odd": 2}
    assert again.select(collections=["odd"]) == ["doc03", "doc05"]


def test_a_filter_of_another_json_type_than_its_field_is_refused(tmp_path, unit_vectors):
    from kvfuse.retriever import FilterTypeError

    idx = VectorIndex.open(tmp_path / "faiss", DIM, _settings("flat"))
    idx.add("a", unit_vectors(2, DIM, seed=1), {"year": 2020, "flag": True, "tag": "x"})
    idx.add("b", unit_vectors(2, DIM, seed=2), {"year": 2021.5, "flag": False}, collection="other")
    q = unit_vectors(1, DIM, seed=3)[0]
    with pytest.raises(FilterTypeError, match="'year' is a string, but the documents searched store 'year' as number"):
        idx.search(q, 4, filters={"year": "2020"})
    with pytest.raises(FilterTypeError) as err:
        idx.select(filters={"flag": 1})  # true is not 1, even where Python says True == 1
    assert err.value.field == "flag"
    assert [h.document_id for h in idx.search(q, 4, filters={"year": 2020})] == ["a", "a"]
    assert idx.select(filters={"year": 2020.0, "flag": True}) == ["a"]  # numbers compare as numbers
    # Only the collections searched count: "tag" exists nowhere in "other", so nothing to check there.
    assert idx.select(filters={"tag": 7}, collections=["other"]) == []
    assert idx.select(filters={"unknown": "x"}) == []
