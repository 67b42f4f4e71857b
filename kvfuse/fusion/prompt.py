"""Where the documents and the question go in the model's chat template.

The prompt is prefix + documents + question: the template rendered up to the user's content (with the
system prompt), the chunks, then the question and the template from the end of the user turn through the
assistant header. Tokenizer only, no model: the API process uses it too (the `prefix` precompute
context, kvfuse/service/rag/precompute_context.py; the prompt size check before retrieval,
kvfuse/service/rag/prompt_size.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvfuse.fusion.errors import FusionError

_SENTINEL = "\u2063KVFUSE-DOCUMENTS\u2063"  # placed in the user turn to find where documents go
QUESTION_TEMPLATE = "\n\nQuestion: {question}"  # the question part, before the template's turn end


def template_halves(tokenizer: Any, system_prompt: str | None) -> tuple[str, str]:
    """The chat template's text before and after the user's content."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": _SENTINEL})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
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


def prompt_texts(tokenizer: Any, question: str, system_prompt: str | None,
                 history: Sequence[Sequence[str]] = ()) -> tuple[str, str]:
    """(prefix, question part): the two texts of the prompt around the documents, as tokenized. Earlier
    turns of a conversation go in the question part, after the documents, so the prefix (and every chunk
    cache computed after it) is the same with or without them."""
    before, after = template_halves(tokenizer, system_prompt)
    return before, history_text(history) + QUESTION_TEMPLATE.format(question=question) + after


def overflow(prompt_tokens: int, max_tokens: int, limit: int) -> str | None:
    """Why a prompt of `prompt_tokens` (documents aside) plus `max_tokens` cannot fit a context of `limit`
    tokens, or None when it can."""
    excess = prompt_tokens + max_tokens - limit
    if excess <= 0:
        return None
    return (f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceed the model context of "
            f"{limit} tokens by {excess}")
