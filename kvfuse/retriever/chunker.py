"""Token-aware chunking with the LLM's own tokenizer.

A chunk's token ids are exactly what its KV cache is computed on, so they must be the document's own
tokens: the document is tokenized once, with character offsets, and the cuts are chosen among token
indices. Tokenizing pieces separately would change the tokens at the seams (BPE merges across them),
and the chunks would no longer concatenate back to the document.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvfuse.retriever.errors import EmptyDocumentError

# Quality of a cut placed just before a token; higher is better.
MID_CHARACTER = -1  # the token starts inside a character another token also covers (byte fallback)
MID_WORD = 0
WORD = 1
SENTENCE = 2
PARAGRAPH = 3

_SENTENCE_END = ".!?"
_CLOSERS = "\"')]}\u201d\u2019\u00bb"  # may follow the sentence's final punctuation: `."` or `.)`


@dataclass
class Chunk:
    index: int
    token_ids: list[int]
    text: str  # text[start_char:end_char] of the document; the chunks' texts tile the document
    start_char: int
    end_char: int


class Chunker:
    """Splits a document into chunks of at most `chunk_tokens` tokens.

    Cut preference: paragraph, then sentence, then word boundary, and a cut mid-word only when a window
    holds no boundary at all. A chunk is first sought in the second half of the window (so a boundary
    near the start of the window does not leave a tiny chunk); a better boundary in the first half is
    taken only when the second half offers less than a sentence boundary.
    """

    def __init__(self, tokenizer: Any, chunk_tokens: int):
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        if not getattr(tokenizer, "is_fast", False):
            raise TypeError("Chunker needs a fast (Rust) tokenizer: it relies on character offsets")
        self.tokenizer = tokenizer
        self.chunk_tokens = chunk_tokens
        self._lock = threading.Lock()  # a fast tokenizer is not safe to call from several threads at once

    @classmethod
    def from_pretrained(cls, path: str, chunk_tokens: int) -> Chunker:
        """Load only the tokenizer of the model at `path` (never the model)."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path), chunk_tokens)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest token as the vocabulary spells it, which is never shorter than the
        text the token stands for (byte-level vocabularies spell one byte per character, SentencePiece
        one character per character): a text longer than n times this has more than n tokens, which is
        known without tokenizing it."""
        return max(map(len, self.tokenizer.get_vocab()))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` with no special tokens added (thread-safe)."""
        with self._lock:
            return list(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

    def token_starts(self, text: str) -> list[int]:
        """The character offset each token of `text` starts at (thread-safe): where a span of tokens begins."""
        with self._lock:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        return [int(a) for a, _ in enc["offset_mapping"]]

    def chunk(self, text: str) -> list[Chunk]:
        if not text or text.isspace():
            raise EmptyDocumentError("document text is empty or whitespace only: nothing to chunk")
        with self._lock:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        ids: list[int] = list(enc["input_ids"])
        if not ids:
            raise EmptyDocumentError("the tokenizer produced no tokens for this document")
        offsets: list[tuple[int, int]] = [(int(a), int(b)) for a, b in enc["offset_mapping"]]
        levels = cut_levels(text, offsets)
        cuts = choose_cuts(levels, len(ids), self.chunk_tokens)
        return _assemble(text, ids, offsets, cuts)


def cut_levels(text: str, offsets: list[tuple[int, int]]) -> np.ndarray:
    """levels[j] = quality of a cut just before token j (levels[0] is unused)."""
    n = len(offsets)
    levels = np.full(n, MID_WORD, dtype=np.int8)
    for j in range(1, n):
        start, end = offsets[j]
        if start < offsets[j - 1][1]:
            levels[j] = MID_CHARACTER
            continue
        # The token's first visible character; a whitespace-only token is never a good place to start,
        # the cut goes after the whitespace instead.
        x = start
        while x < end and text[x].isspace():
            x += 1
        if x == end:
            continue
        g0 = start  # start of the whitespace run before the visible character
        while g0 > 0 and text[g0 - 1].isspace():
            g0 -= 1
        if g0 == 0:
            continue
        gap = text[g0:x]
        if gap.count("\n") >= 2:
            levels[j] = PARAGRAPH
        elif _ends_sentence(text, g0) and (gap or text[x].isupper() or text[x] in "\"'\u201c\u2018"):
            # Without a gap only "word.Next" counts: some texts lost their paragraph breaks that way.
            levels[j] = SENTENCE
        elif gap:
            levels[j] = WORD
    return levels


def _ends_sentence(text: str, end: int) -> bool:
    """Does text[:end] end with sentence-final punctuation (optionally followed by closers)?"""
    i = end - 1
    while i >= 0 and text[i] in _CLOSERS:
        i -= 1
    return i >= 0 and i < end and text[i] in _SENTENCE_END


def choose_cuts(levels: np.ndarray, n: int, limit: int) -> list[int]:
    """Token indices where chunks start, after 0; every chunk has 1..limit tokens."""
    cuts: list[int] = []
    a = 0
    half = max(1, limit // 2)
    while n - a > limit:
        hi = a + limit  # the cut j makes chunk [a, j): j <= a + limit
        late = _best(levels, a + half, hi)
        whole = _best(levels, a + 1, hi)
        j = late if levels[late] >= SENTENCE or levels[late] >= levels[whole] else whole
        cuts.append(j)
        a = j
    return cuts


def _best(levels: np.ndarray, lo: int, hi: int) -> int:
    """The last index in [lo, hi] holding the highest level."""
    window = levels[lo : hi + 1]
    return hi - int(np.argmax(window[::-1]))


def _assemble(text: str, ids: list[int], offsets: list[tuple[int, int]], cuts: list[int]) -> list[Chunk]:
    bounds = [0, *cuts, len(ids)]
    # Character cut before token j: where the token starts, but never before the previous token's end
    # (a forced cut inside a byte-fallback character gives that character to the earlier chunk).
    chars = [0] + [max(offsets[j][0], offsets[j - 1][1]) for j in cuts] + [len(text)]
    return [
        Chunk(
            index=i,
            token_ids=ids[bounds[i] : bounds[i + 1]],
            text=text[chars[i] : chars[i + 1]],
            start_char=chars[i],
            end_char=chars[i + 1],
        )
        for i in range(len(bounds) - 1)
    ]
