"""Metadata filters (retriever/filters.py): each operator against hand-checked documents, the JSON-type
rule, the errors that name the place of a malformed filter, and the vector index applying them."""

from __future__ import annotations

import numpy as np
import pytest

from kvfuse.config import RetrieverSettings
from kvfuse.retriever.errors import FilterSyntaxError, FilterTypeError
from kvfuse.retriever.filters import parse
from kvfuse.retriever.index import VectorIndex

DOCS = {
    "a": {"year": 1999, "kind": "essay", "draft": False},
    "b": {"year": 2005, "kind": "memo", "draft": True},
    "c": {"year": 2020, "kind": "essay"},
    "d": {"kind": "note", "year": "2020"},  # a string year: never equal to the number 2020
}


def matching(spec: dict) -> list[str]:
    flt = parse(spec)
    return [d for d, meta in DOCS.items() if flt.matches(meta)]


@pytest.mark.parametrize(("spec", "expected"), [
    ({"kind": "essay"}, ["a", "c"]),
    ({"kind": {"$eq": "essay"}}, ["a", "c"]),
    ({"kind": {"$ne": "essay"}}, ["b", "d"]),
    ({"year": {"$gt": 1999}}, ["b", "c"]),
    ({"year": {"$gte": 1999}}, ["a", "b", "c"]),
    ({"year": {"$lt": 2020}}, ["a", "b"]),
    ({"year": {"$lte": 2005, "$gt": 1999}}, ["b"]),
    ({"kind": {"$in": ["memo", "note"]}}, ["b", "d"]),
    ({"kind": {"$nin": ["memo", "note"]}}, ["a", "c"]),
    ({"draft": {"$ne": True}}, ["a", "c", "d"]),  # absent fields pass $ne and $nin (MongoDB's rule)
    ({"draft": {"$nin": [True]}}, ["a", "c", "d"]),
    ({"draft": False}, ["a"]),
    ({"year": 2020}, ["c"]),  # the number, not the string "2020"
    ({"year": "2020"}, ["d"]),
    ({"year": {"$gt": "2000"}}, ["d"]),  # strings compare with strings only
    ({"$or": [{"kind": "memo"}, {"year": {"$gte": 2020}}]}, ["b", "c"]),
    ({"$and": [{"kind": "essay"}, {"year": {"$lt": 2000}}]}, ["a"]),
    ({"$or": [{"$and": [{"kind": "essay"}, {"year": 1999}]}, {"kind": "note"}]}, ["a", "d"]),
    ({"kind": "essay", "$or": [{"year": 1999}, {"year": 2005}]}, ["a"]),
])
def test_each_operator_selects_the_documents_it_names(spec: dict, expected: list[str]) -> None:
    assert matching(spec) == expected


@pytest.mark.parametrize(("spec", "path"), [
    ({"year": {"$gtt": 1}}, "filters.year"),
    ({"$nor": [{"a": 1}]}, "filters.$nor"),
    ({"kind": {"$in": "essay"}}, "filters.kind"),
    ({"kind": {"$in": []}}, "filters.kind"),
    ({"kind": {}}, "filters.kind"),
    ({"$or": []}, "filters.$or"),
    ({"$or": [{"kind": {"$gt": True}}]}, "filters.$or.0.kind"),
    ({"kind": {"$eq": ["a"]}}, "filters.kind.$eq"),
    ({"year": {"$lt": float("nan")}}, "filters.year.$lt"),
    ({"year": float("inf")}, "filters.year"),  # a bare Infinity, which Python's json reads
])
def test_a_malformed_filter_is_refused_naming_its_place(spec: dict, path: str) -> None:
    with pytest.raises(FilterSyntaxError) as err:
        parse(spec)
    assert err.value.path == path


def test_a_filter_nested_too_deep_is_refused_not_a_recursion_error() -> None:
    spec: dict = {"kind": "essay"}
    for _ in range(300):
        spec = {"$and": [spec]}
    with pytest.raises(FilterSyntaxError, match="nested more than"):
        parse(spec)
    shallow: dict = {"kind": "essay"}
    for _ in range(5):
        shallow = {"$or": [shallow, {"year": 1}]}
    assert matching(shallow) == ["a", "c"]


def test_the_vector_index_applies_the_operators_and_refuses_a_type_no_document_has(tmp_path) -> None:
    index = VectorIndex(tmp_path, 4, RetrieverSettings(index_type="flat"))
    rng = np.random.default_rng(0)
    for doc_id, meta in DOCS.items():
        v = rng.normal(size=(2, 4)).astype(np.float32)
        index.add(doc_id, v / np.linalg.norm(v, axis=1, keepdims=True), meta)
    assert index.select(filters={"year": {"$gte": 2005}}) == ["b", "c"]
    hits = index.search(np.ones(4, dtype=np.float32) / 2, 8, filters={"$or": [{"kind": "memo"}, {"draft": False}]})
    assert {h.document_id for h in hits} == {"a", "b"} and len(hits) == 4
    with pytest.raises(FilterTypeError):
        index.select(filters={"kind": {"$in": [1, 2]}})
    with pytest.raises(FilterSyntaxError):
        index.select(filters={"kind": {"$regex": "e.*"}})
