"""Answer scoring: RULER-style string match for the synthetic tasks, LongBench token F1 for MuSiQue."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

from kvfuse.answer_match import normalize_answer

__all__ = ["best_f1", "contains", "match_share", "normalize_answer", "score", "token_f1"]


def token_f1(prediction: str, reference: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    common = Counter(pred) & Counter(ref)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_f1(prediction: str, references: Sequence[str]) -> float:
    """F1 against the best-matching reference answer (LongBench takes the max over answers)."""
    return max((token_f1(prediction, r) for r in references), default=0.0)


def contains(prediction: str, reference: str) -> bool:
    """Exact match of the reference as a whole word run in the prediction, case-insensitive: "1234567"
    matches "is 1234567." but not "12345678" (RULER's string match, made whole-word)."""
    pattern = r"(?<![\w])" + re.escape(reference.strip().lower()) + r"(?![\w])"
    return re.search(pattern, prediction.lower()) is not None


def match_share(prediction: str, references: Sequence[str]) -> float:
    """Share of the references found in the prediction (1 reference: exact match, 0 or 1)."""
    if not references:
        return 0.0
    return sum(contains(prediction, r) for r in references) / len(references)


def score(metric: str, prediction: str, references: Sequence[str]) -> float:
    if metric == "match":
        return match_share(prediction, references)
    if metric == "f1":
        return best_f1(prediction, references)
    raise ValueError(f"unknown metric {metric!r}")
