"""Refusing a prompt that cannot fit the model context before any expensive work is spent on it.

The worker checks every prompt exactly, but only after this process has embedded the question for
retrieval. A huge question is many embedder windows, and the embedder serves one call at a time: every
other query would wait behind it, only for it to be refused in the end. So a query is checked here first,
in two steps that each cost little next to the embedding:

1. Characters: a text longer than (context tokens x the longest token's characters) cannot fit, whatever
   it says; refused without tokenizing it (see `Chunker.max_token_chars`).
2. Tokens: the prefix and the question part, exactly as the worker will tokenize them (the same texts,
   `fusion.prompt.prompt_texts`, and the same tokenizer), plus max_tokens, against the context.

The context is the one the worker reports; before it has, the configured `model.max_context_tokens`
(the model's own may be smaller: a larger limit refuses less, never wrongly), or no check.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvfuse.fusion.prompt import overflow, prompt_texts
from kvfuse.service.errors import APIError
from kvfuse.service.wire.protocol import ERR_MAX_TOKENS

if TYPE_CHECKING:
    from kvfuse.config import Settings
    from kvfuse.retriever import Chunker

PROMPT_TOO_LONG = "prompt_too_long"  # the question and system prompt alone cannot fit the context -> 400


def context_limit(worker_info: dict, settings: Settings) -> int | None:
    """The model context in tokens (prompt and answer together), if known yet: the worker's, as it
    reported it (`worker_info`), else the configured one."""
    return worker_info.get("max_context_tokens") or settings.model.max_context_tokens or None


async def check_prompt_fits(chunker: Chunker, limit: int | None, question: str, system_prompt: str,
                            max_tokens: int, history: Sequence[Sequence[str]] = ()) -> None:
    """Raise 400 if the prompt (documents aside, a conversation's earlier turns in) plus max_tokens cannot
    fit `limit` tokens (no check when the limit is not known yet)."""
    if limit is None:
        return
    prefix, question_part = prompt_texts(chunker.tokenizer, question, system_prompt, history=history)
    chars, bound = len(prefix) + len(question_part), limit * chunker.max_token_chars
    if chars > bound:
        raise APIError(400, f"the query and system prompt are {chars} characters long: a model context of {limit} "
                       f"tokens holds at most {bound} ({chunker.max_token_chars} per token)",
                       code=PROMPT_TOO_LONG, param="query")
    tokens = await asyncio.to_thread(lambda: len(chunker.encode(prefix)) + len(chunker.encode(question_part)))
    too_long = overflow(tokens, max_tokens, limit)
    if too_long:
        alone = tokens >= limit  # no max_tokens would make it fit
        raise APIError(400, too_long, code=PROMPT_TOO_LONG if alone else ERR_MAX_TOKENS,
                       param="query" if alone else "max_tokens")
