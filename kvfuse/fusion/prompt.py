"""Where the documents and the question go in the model's chat template (or the base-model prompt:
prompt_style.py).

The prompt is prefix + documents + question: the template rendered up to the user's content (with the
system prompt), the chunks, then the question and the template from the end of the user turn through the
assistant header.

Two renderings of the documents (`model.prompt_layout`, docs/DESIGN.md "The prompt"):

- `plain`: the chunks' texts run together, then "Question: …".
- `labelled`: each chunk is a block, "Document (title: T)\n" + its text + a blank line, cached with the
  chunk (the header depends on the document only, so a chunk's cache is the same at any rank); the
  numbers, which depend on the rank at query time, go in the question part, which every method
  prefills per query: "Documents, in order: [1] T1; [2] T2.". Sources and answers refer to [n].

A conversation's earlier turns go in the question part too, so the prefix and every chunk cache are the
same with or without them. Tokenizer only, no model: the API process uses it too (the `prefix` precompute
context, kvfuse/service/rag/precompute_context.py; the prompt size check before retrieval,
kvfuse/service/rag/prompt_size.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvfuse.fusion.errors import FusionError
from kvfuse.fusion.prompt_style import BASE, base_halves, messages_for, render, style_of

_SENTINEL = "\u2063KVFUSE-DOCUMENTS\u2063"  # placed in the user turn to find where documents go
QUESTION_TEMPLATE = "\n\nQuestion: {question}"  # the question part, before the template's turn end
PROMPT_LAYOUTS = ("plain", "labelled")
CHUNK_HEADER = "Document (title: {name})\n"  # labelled: cached with the chunk's text
CHUNK_END = "\n\n"  # labelled: the separator after each chunk, cached with it
INDEX_TEMPLATE = "Documents, in order: {labels}."  # labelled: the rank-dependent part, in the question part


PROMPT_ORDERS = ("best-first", "best-last")


def in_prompt_order(ranked: list[Any], order: str) -> list[Any]:
    """Retrieved chunks (best first) in the order the prompt lays them out: `best-first` as ranked,
    `best-last` reversed, the best next to the question (the end half of LangChain's LongContextReorder)."""
    if order not in PROMPT_ORDERS:
        raise ValueError(f"unknown prompt order {order!r}; choose from {', '.join(PROMPT_ORDERS)}")
    return list(ranked) if order == "best-first" else list(reversed(ranked))


def check_layout(layout: str) -> str:
    if layout not in PROMPT_LAYOUTS:
        raise ValueError(f"unknown prompt layout {layout!r}; choose from {', '.join(PROMPT_LAYOUTS)}")
    return layout


def chunk_block(text: str, name: str, layout: str) -> str:
    """A chunk's text as cached: itself (`plain`), or with its document's header and separator."""
    if check_layout(layout) == "plain":
        return text
    return CHUNK_HEADER.format(name=name) + text + CHUNK_END


def block_ids(tokenize: Any, text_ids: list[int], name: str, layout: str) -> list[int]:
    """A chunk's token ids as cached and fused: its text's ids, between the header's and the separator's
    (`labelled`; each part tokenized alone, so the text's ids are the chunker's), or the text's alone."""
    if check_layout(layout) == "plain":
        return list(text_ids)
    return list(tokenize(CHUNK_HEADER.format(name=name))) + list(text_ids) + list(tokenize(CHUNK_END))


def document_names(names: list[str]) -> str:
    """"[1] a; [2] b": the number each chunk has in the prompt, first chunk 1."""
    return "; ".join(f"[{i}] {n}" for i, n in enumerate(names, start=1))


def template_halves(tokenizer: Any, system_prompt: str | None) -> tuple[str, str]:
    """The prompt's text before and after the user's content, in the tokenizer's prompt style
    (prompt_style.py: the chat template, with the system text in the user turn where it must be, or the
    base-model prompt)."""
    style = style_of(tokenizer)
    if style.name == BASE:
        return base_halves(style, system_prompt)
    text = render(tokenizer, messages_for(style, system_prompt, _SENTINEL))
    if text.count(_SENTINEL) != 1:
        raise FusionError("the chat template does not render the user message verbatim")
    before, after = text.split(_SENTINEL)
    return before, after


HISTORY_TEMPLATE = "\n\nConversation so far:\n{turns}"  # earlier turns, before the question
_SPEAKERS = {"user": "User", "assistant": "Assistant"}


def history_text(history: Sequence[Sequence[str]]) -> str:
    """Earlier turns of a conversation, (role, text) oldest first, as the prompt shows them ("" for none)."""
    if not history:
        return ""
    turns = "\n".join(f"{_SPEAKERS.get(role, role.title())}: {text}" for role, text in history)
    return HISTORY_TEMPLATE.format(turns=turns)


def prompt_texts(tokenizer: Any, question: str, system_prompt: str | None, names: list[str] | None = None,
                 layout: str = "plain", history: Sequence[Sequence[str]] = ()) -> tuple[str, str]:
    """(prefix, question part): the two texts of the prompt around the documents, as tokenized. `names`:
    the documents' names in prompt order (`labelled`: listed with their numbers before the question).
    Earlier turns of a conversation go in the question part, after the documents, so the prefix (and every
    chunk cache computed after it) is the same with or without them."""
    before, after = template_halves(tokenizer, system_prompt)
    asked = history_text(history) + QUESTION_TEMPLATE.format(question=question)
    if check_layout(layout) == "labelled" and names:
        asked = INDEX_TEMPLATE.format(labels=document_names(names)) + asked
    return before, asked + after


def overflow(prompt_tokens: int, max_tokens: int, limit: int) -> str | None:
    """Why a prompt of `prompt_tokens` (documents aside) plus `max_tokens` cannot fit a context of `limit`
    tokens, or None when it can."""
    excess = prompt_tokens + max_tokens - limit
    if excess <= 0:
        return None
    return (f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceed the model context of "
            f"{limit} tokens by {excess}")


def stop_token_ids(tokenizer, generation_config) -> set[int]:
    """The ids that end an answer: EOS (the tokenizer's and the generation config's) and the chat
    template's end-of-turn token (the first special token after the user's content)."""
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    if style_of(tokenizer).name != BASE:
        special = set(tokenizer.all_special_ids)
        tail = tokenizer(template_halves(tokenizer, None)[1], add_special_tokens=False)["input_ids"]
        tail = [i for i in tail if i in special]
        if tail:
            ids.add(tail[0])
    return ids
