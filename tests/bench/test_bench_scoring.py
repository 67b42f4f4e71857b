"""Scorers: LongBench F1 normalization and RULER-style exact match."""

from __future__ import annotations

import pytest

from kvfuse.bench.scoring import best_f1, contains, match_share, normalize_answer, score, token_f1


def test_normalize_drops_case_punctuation_articles_and_extra_space():
    assert normalize_answer("  The Cat, sat on a MAT! ") == "cat sat on mat"
    assert normalize_answer("An apple.") == "apple"
    # articles only as whole words
    assert normalize_answer("theory and anthem") == "theory and anthem"


def test_token_f1():
    assert token_f1("Exeter College", "Exeter College") == 1.0
    assert token_f1("the Exeter College.", "exeter college") == 1.0
    # pred: [exeter, college, oxford]; ref: [exeter, college] -> P = 2/3, R = 1, F1 = 0.8
    assert token_f1("Exeter College, Oxford", "Exeter College") == pytest.approx(0.8)
    assert token_f1("Cambridge", "Exeter College") == 0.0
    assert token_f1("", "Exeter College") == 0.0
    # repeated tokens count once per occurrence in both
    assert token_f1("paris paris", "paris") == pytest.approx(2 * 0.5 * 1 / 1.5)


def test_best_f1_takes_the_best_reference():
    assert best_f1("Exeter College", ["Oxford", "Exeter College"]) == 1.0
    assert best_f1("anything", []) == 0.0


def test_contains_is_whole_word_and_case_insensitive():
    assert contains("The special magic number is 1234567.", "1234567")
    assert not contains("The number is 12345678.", "1234567")
    assert not contains("The number is 01234567", "1234567")
    assert contains("They are abcde, FGHIJ and KLMNO", "fghij")
    assert not contains("ABCDEF", "ABCDE")


def test_match_share_and_score_dispatch():
    assert match_share("1111111 and 2222222", ["1111111", "2222222", "3333333", "4444444"]) == 0.5
    assert match_share("1111111", ["1111111"]) == 1.0
    assert score("match", "it is 7654321", ["7654321"]) == 1.0
    assert score("f1", "Exeter College", ["Exeter College"]) == 1.0
    with pytest.raises(ValueError):
        score("bleu", "a", ["a"])
