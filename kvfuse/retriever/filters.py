"""Metadata filters: Chroma's and MongoDB's convention, matched against one document's metadata.

A filter is a JSON object. `{"field": value}` is equality; `{"field": {"$op": operand, ...}}` applies
each operator (all must hold): `$eq $ne $gt $gte $lt $lte` take one scalar, `$in $nin` a list of them.
`{"$and": [filter, ...]}` and `{"$or": [filter, ...]}` combine filters; several keys in one object must
all hold. Values match only a field of the same JSON type (true is not 1, "2020" is not 2020); the order
operators compare numbers with numbers and strings with strings. A document without the field fails
every operator but `$ne` and `$nin` (as in MongoDB: it is "not equal" to anything). The vector index
applies filters (`VectorIndex.select`) and the keyword index searches what it selects, so a filter means
the same in every retrieval mode. See docs/DESIGN.md, Retrieval.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvfuse.retriever.errors import FilterSyntaxError

SCALAR_OPS = ("$eq", "$ne", "$gt", "$gte", "$lt", "$lte")
LIST_OPS = ("$in", "$nin")
LOGICAL_OPS = ("$and", "$or")
_ORDERED = ("$gt", "$gte", "$lt", "$lte")
MAX_DEPTH = 16  # $and / $or nested deeper than any real filter: refused before the parser recurses far


def kind(value: object) -> str:
    """A metadata value's JSON type: what a filter must share with the field to match it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return {"list": "array", "dict": "object"}.get(type(value).__name__, type(value).__name__)


def same(stored: object, wanted: object) -> bool:
    """Equal and of one JSON type: true is not 1, "1" is not 1 (Python alone says True == 1)."""
    return kind(stored) == kind(wanted) and stored == wanted


_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    "$gt": lambda a, b: a > b, "$gte": lambda a, b: a >= b, "$lt": lambda a, b: a < b, "$lte": lambda a, b: a <= b,
}


@dataclass(frozen=True)
class Condition:
    """One operator on one field: `field op operand` (operand a list for $in/$nin)."""

    field: str
    op: str
    operand: Any

    def matches(self, meta: dict) -> bool:
        if self.field not in meta:
            return self.op in ("$ne", "$nin")
        v = meta[self.field]
        if self.op == "$eq":
            return same(v, self.operand)
        if self.op == "$ne":
            return not same(v, self.operand)
        if self.op == "$in":
            return any(same(v, o) for o in self.operand)
        if self.op == "$nin":
            return not any(same(v, o) for o in self.operand)
        return kind(v) == kind(self.operand) and _COMPARE[self.op](v, self.operand)

    def kinds(self) -> set[str]:
        return {kind(o) for o in self.operand} if self.op in LIST_OPS else {kind(self.operand)}


@dataclass(frozen=True)
class Filter:
    """A parsed filter: `all_of` every part (`any_of` for an $or node)."""

    parts: tuple[Condition | Filter, ...]
    any_of: bool = False

    def matches(self, meta: dict) -> bool:
        test = any if self.any_of else all
        return test(p.matches(meta) for p in self.parts)

    def conditions(self) -> Iterator[Condition]:
        for p in self.parts:
            if isinstance(p, Condition):
                yield p
            else:
                yield from p.conditions()


def parse(spec: Any, path: str = "filters", depth: int = 0) -> Filter:
    """The filter `spec` (a request's `filters`), checked; raises FilterSyntaxError naming the place."""
    if depth > MAX_DEPTH:
        raise FilterSyntaxError(path, f"{path}: $and / $or nested more than {MAX_DEPTH} deep")
    if not isinstance(spec, dict):
        raise FilterSyntaxError(path, f"{path} must be a JSON object, got {kind(spec)}")
    parts: list[Condition | Filter] = []
    for key, value in spec.items():
        if key in LOGICAL_OPS:
            if not isinstance(value, list) or not value:
                raise FilterSyntaxError(f"{path}.{key}", f"{path}.{key} must be a non-empty list of filters")
            subs = tuple(parse(v, f"{path}.{key}.{i}", depth + 1) for i, v in enumerate(value))
            parts.append(Filter(subs, any_of=key == "$or"))
        elif key.startswith("$"):
            raise FilterSyntaxError(f"{path}.{key}", f"unknown operator {key!r} at {path}; fields are combined "
                                    f"with {', '.join(LOGICAL_OPS)}")
        elif isinstance(value, dict):
            if not value:
                raise FilterSyntaxError(f"{path}.{key}", f"{path}.{key} has no operator")
            parts.extend(_condition(key, op, operand, f"{path}.{key}") for op, operand in value.items())
        else:
            parts.append(_condition(key, "$eq", value, f"{path}.{key}", implicit=True))
    return Filter(tuple(parts))


def _condition(field: str, op: str, operand: Any, path: str, implicit: bool = False) -> Condition:
    if op in LIST_OPS:
        if not isinstance(operand, list) or not operand:
            raise FilterSyntaxError(path, f"{path}.{op} must be a non-empty list of values")
        for o in operand:
            _scalar(o, f"{path}.{op}")
        return Condition(field, op, tuple(operand))
    if op not in SCALAR_OPS:
        raise FilterSyntaxError(path, f"unknown operator {op!r} at {path}; one of "
                                f"{', '.join(SCALAR_OPS + LIST_OPS)}")
    _scalar(operand, path if implicit else f"{path}.{op}")
    if op in _ORDERED and kind(operand) not in ("number", "string"):
        raise FilterSyntaxError(path, f"{path}.{op} compares numbers or strings, got {kind(operand)}")
    return Condition(field, op, operand)


def _scalar(value: Any, path: str) -> None:
    if isinstance(value, dict | list):
        raise FilterSyntaxError(path, f"{path} must be a string, number, boolean or null, got {kind(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise FilterSyntaxError(path, f"{path} must be a finite number")
