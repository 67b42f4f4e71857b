"""Whether two answers say the same thing: the one definition the fidelity benchmarks (kvfuse/bench) and
the service's live fidelity checks share.

Two measures, named by `fidelity.metric` in the service and by the reports' columns:

- `text`: the same normalised answer (LongBench/SQuAD normalisation: lower case, no punctuation or
  articles, squeezed whitespace). Strict: "4231647." and "4231647. This number is" differ.
- `value`: the same extracted answer (`extract_value`): the first number when the answer has one, else
  its first sentence, normalised. It asks whether the answer *says* the same thing, not whether the
  model kept talking identically after saying it.

See docs/DESIGN.md, "Fidelity measures".
"""

from __future__ import annotations

import re
import string

METRICS = ("text", "value")

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)
# A number as answers write it: digits with optional thousands separators and one decimal part.
_NUMBER = re.compile(r"(?<![\w])[-+]?\d[\d,]*(?:\.\d+)?")
_SENTENCE_END = re.compile(r"(?<=[^\d])[.!?](?:\s|$)|\n")


def normalize_answer(text: str) -> str:
    """LongBench/SQuAD normalization: lower case, drop punctuation and articles, squeeze whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def extract_value(text: str) -> str:
    """The answer's value: its first number (separators dropped, trailing ".0" kept as written), else its
    first sentence normalised; "" for an empty answer."""
    number = _NUMBER.search(text)
    if number:
        return number.group(0).replace(",", "").lstrip("+")
    first = _SENTENCE_END.split(text.strip(), maxsplit=1)[0]
    return normalize_answer(first)


def same_answer(a: str, b: str, metric: str = "text") -> bool:
    """Whether answers `a` and `b` agree under `metric` ("text" or "value")."""
    if metric == "text":
        return normalize_answer(a) == normalize_answer(b)
    if metric == "value":
        return extract_value(a) == extract_value(b)
    raise ValueError(f"unknown answer metric {metric!r}; expected one of {', '.join(METRICS)}")
