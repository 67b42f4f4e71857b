"""The prompt size check that runs before retrieval (kvfuse/service/rag/prompt_size.py): the real LLM
tokenizer and the configured context limit (as before a worker has reported its own), no server."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvfuse.retriever import Chunker
from kvfuse.service.errors import APIError
from kvfuse.service.rag.prompt_size import check_prompt_fits, context_limit

LIMIT = 1024


@pytest.fixture(scope="module")
def chunker(default_llm_path: str) -> Chunker:
    return Chunker.from_pretrained(default_llm_path, 128)


@pytest.fixture
def state(chunker: Chunker, limit: int | None) -> tuple[Chunker, int | None]:
    return chunker, limit


@pytest.fixture
def limit(settings_factory) -> int | None:
    return context_limit({}, settings_factory(model={"max_context_tokens": LIMIT}))  # no worker info yet


def _refusal(state: tuple[Chunker, int | None], question: str, max_tokens: int = 8) -> APIError | None:
    try:
        asyncio.run(check_prompt_fits(*state, question, "Answer briefly.", max_tokens))
    except APIError as err:
        return err
    return None


def test_a_prompt_that_fits_passes(state: tuple[Chunker, int | None]) -> None:
    assert _refusal(state, "What do barn owls eat?") is None


def test_a_question_longer_than_the_context_is_refused_naming_the_query(state: tuple[Chunker, int | None]) -> None:
    err = _refusal(state, "why " * 2 * LIMIT)  # about one token per word
    assert err is not None and err.status == 400 and err.code == "prompt_too_long" and err.param == "query"
    assert f"model context of {LIMIT} tokens" in err.message


def test_max_tokens_that_tip_a_fitting_prompt_over_are_named(state: tuple[Chunker, int | None]) -> None:
    err = _refusal(state, "What do barn owls eat?", max_tokens=LIMIT)
    assert err is not None and err.status == 400
    assert err.code == "max_tokens_overflow" and err.param == "max_tokens"  # the worker's code for the same case


def test_a_text_too_long_in_characters_is_refused_without_tokenizing(state: tuple[Chunker, int | None], chunker: Chunker) -> None:
    # Tokenizing this many characters takes seconds; the character bound answers at once.
    question = "x" * (LIMIT * chunker.max_token_chars + 1) * 10
    t0 = time.monotonic()
    err = _refusal(state, question)
    assert err is not None and err.code == "prompt_too_long" and "characters" in err.message
    assert time.monotonic() - t0 < 2.0


def test_no_token_stands_for_more_characters_than_the_bound_assumes(chunker: Chunker) -> None:
    # The premise of the character bound: it never refuses a text that could fit.
    tok = chunker.tokenizer
    longest = max(len(tok.decode([i])) for i in range(len(tok)))
    assert 0 < longest <= chunker.max_token_chars


def test_without_a_known_limit_nothing_is_refused(settings_factory, chunker: Chunker) -> None:
    limit = context_limit({}, settings_factory())  # no worker has reported, no configured limit
    assert limit is None and _refusal((chunker, limit), "why " * 10_000) is None
