"""The answer comparisons shared by the fidelity benchmarks and the live checks (kvfuse/answer_match.py)."""

import pytest

from kvfuse.answer_match import extract_value, same_answer


@pytest.mark.parametrize(("a", "b"), [
    ("4231647.", "4231647. This number is"),
    ("The answer is 1,234 apples", "1234"),
    ("Paris is the capital. It lies on the Seine", "paris is the capital!"),
])
def test_value_agreement_ignores_what_follows_the_answer(a, b):
    assert same_answer(a, b, "value")
    assert not same_answer(a, b, "text")


def test_value_agreement_sees_a_different_number_or_sentence():
    assert not same_answer("4231647.", "4231648.", "value")
    assert not same_answer("Paris.", "Lyon.", "value")
    assert extract_value("") == ""


def test_text_agreement_is_normalised_equality_and_unknown_metrics_are_refused():
    assert same_answer("The Cat!", "cat", "text")
    with pytest.raises(ValueError, match="unknown answer metric"):
        same_answer("a", "b", "bleu")
