"""Chunking with the default LLM's tokenizer: no token lost or duplicated, limits held, boundaries kept."""

from __future__ import annotations

import re

import pytest

from kvfuse.retriever import Chunker, EmptyDocumentError
from kvfuse.retriever.chunker import PARAGRAPH, SENTENCE, WORD, cut_levels

SENTENCE_END = re.compile(r"[.!?][\"')\]\u201d\u2019]*$")


def _doc_ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


def _assert_exact_tiling(chunks, text: str, ids: list[int], limit: int) -> None:
    assert [t for c in chunks for t in c.token_ids] == ids
    assert "".join(c.text for c in chunks) == text
    assert [c.index for c in chunks] == list(range(len(chunks)))
    for prev, nxt in zip(chunks, chunks[1:], strict=False):
        assert prev.end_char == nxt.start_char
    for c in chunks:
        assert 1 <= len(c.token_ids) <= limit
        assert text[c.start_char : c.end_char] == c.text


def _cut_kind(prev_text: str, next_text: str) -> str:
    """Classify a cut from the texts alone, independently of the chunker's own rules."""
    if "\n\n" in (prev_text[-4:] + next_text[:4]).replace(" ", ""):
        return "paragraph"
    if SENTENCE_END.search(prev_text.rstrip()):
        return "sentence"
    if prev_text[-1:].isspace() or next_text[:1].isspace():
        return "word"
    return "mid-word"


@pytest.mark.parametrize("limit", [512, 64])
def test_every_essay_round_trips(essays, llm_tokenizer, limit):
    chunker = Chunker(llm_tokenizer, limit)
    kinds: dict[str, int] = {}
    for name, text in essays:
        ids = _doc_ids(llm_tokenizer, text)
        chunks = chunker.chunk(text)
        _assert_exact_tiling(chunks, text, ids, limit)
        assert len(chunks) >= -(-len(ids) // limit), name
        for prev, nxt in zip(chunks, chunks[1:], strict=False):
            kind = _cut_kind(prev.text, nxt.text)
            kinds[kind] = kinds.get(kind, 0) + 1
    cuts = sum(kinds.values())
    assert len(essays) == 49 and cuts > 0
    # Essays' words are short: no window of tokens lacks a word boundary.
    assert kinds.get("mid-word", 0) == 0, kinds
    if limit == 512:
        # Sentences are far shorter than half a chunk, so every cut lands on a sentence or paragraph end.
        assert kinds.get("word", 0) == 0, kinds
    else:
        # At 64 tokens a few long sentences leave only word boundaries in a window.
        assert kinds.get("word", 0) <= 0.1 * cuts, kinds


def test_chunks_are_filled_not_fragmented(essays, llm_tokenizer):
    """Cuts prefer the second half of the window: a nearby paragraph break does not leave tiny chunks."""
    chunker = Chunker(llm_tokenizer, 512)
    for name, text in essays:
        chunks = chunker.chunk(text)
        for c in chunks[:-1]:
            assert len(c.token_ids) >= 256, (name, c.index, len(c.token_ids))


def test_cut_preference_paragraph_then_sentence_then_word(llm_tokenizer):
    words = " ".join(f"word{i}" for i in range(30))
    # Boundaries at 2/5 (sentence), 3/5 (paragraph) and 4/5 (sentence) of the text.
    text = f"{words} {words}. {words}.\n\n{words}. {words}"
    enc = llm_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    levels = cut_levels(text, enc["offset_mapping"])
    assert {PARAGRAPH, SENTENCE, WORD} <= set(levels.tolist())
    chunker = Chunker(llm_tokenizer, len(enc.input_ids) - 5)
    # The second half of the window holds the paragraph break and a later sentence end: the paragraph wins.
    assert chunker.chunk(text)[0].text.endswith(".\n\n")
    # Without it, the last sentence end in the window wins over the many word breaks after it.
    first = chunker.chunk(text.replace(".\n\n", ". "))[0]
    assert first.text.endswith(".") and first.text.count(".") == 3
    # Only word breaks in the window: the chunk is filled up to the last one.
    plain = text.replace(".", "").replace("\n\n", " ")
    first = chunker.chunk(plain)[0]
    assert len(first.token_ids) >= len(enc.input_ids) - 5 - 3


def test_early_paragraph_does_not_leave_a_tiny_chunk(llm_tokenizer):
    words = " ".join(f"word{i}" for i in range(30))
    text = f"{words}.\n\n{words}. {words}. {words}. {words}"
    n = len(llm_tokenizer(text, add_special_tokens=False).input_ids)
    first = Chunker(llm_tokenizer, n - 5).chunk(text)[0]
    # The paragraph break sits at 1/5 of the window; a sentence end in its second half is preferred.
    assert len(first.token_ids) > (n - 5) // 2
    assert first.text.rstrip().endswith(".")


def test_sentence_glued_to_next_is_a_boundary(llm_tokenizer):
    """Some texts lost the whitespace between paragraphs ("that.The"): still a sentence boundary."""
    text = "alpha beta gamma delta epsilon zeta eta theta that.The next sentence goes on for a while here"
    ids = _doc_ids(llm_tokenizer, text)
    chunks = Chunker(llm_tokenizer, len(ids) - 2).chunk(text)
    assert chunks[0].text.endswith("that.")
    assert chunks[1].text.startswith("The next")


def test_no_boundary_at_all_cuts_mid_word_losslessly(llm_tokenizer):
    text = "x" * 3000
    ids = _doc_ids(llm_tokenizer, text)
    chunks = Chunker(llm_tokenizer, 16).chunk(text)
    _assert_exact_tiling(chunks, text, ids, 16)
    assert len(chunks) > 1


def test_multibyte_characters_round_trip(llm_tokenizer):
    """Byte-level BPE splits emoji and CJK into several tokens: a cut never splits the character's text."""
    text = ("Café crème 😀🚀 naïve — 東京は大きい都市です。 " * 40).strip()
    ids = _doc_ids(llm_tokenizer, text)
    for limit in (16, 17, 23, 64):
        chunks = Chunker(llm_tokenizer, limit).chunk(text)
        _assert_exact_tiling(chunks, text, ids, limit)


def test_short_document_is_one_chunk(llm_tokenizer):
    text = "  A single short sentence.\n"
    (chunk,) = Chunker(llm_tokenizer, 512).chunk(text)
    assert chunk.token_ids == _doc_ids(llm_tokenizer, text)
    assert (chunk.text, chunk.start_char, chunk.end_char) == (text, 0, len(text))


@pytest.mark.parametrize("text", ["", " ", "\n\n\t  \r\n", "\u3000\u2003"])
def test_empty_or_whitespace_document_is_refused(llm_tokenizer, text):
    with pytest.raises(EmptyDocumentError, match="empty or whitespace only"):
        Chunker(llm_tokenizer, 512).chunk(text)


def test_slow_tokenizer_is_refused_clearly():
    class NoOffsets:
        is_fast = False

    with pytest.raises(TypeError, match="fast"):
        Chunker(NoOffsets(), 512)
