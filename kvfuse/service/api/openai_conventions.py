"""What makes /v1/chat/completions read like OpenAI's to its clients: the model names it answers to, the
parameters it refuses rather than ignores, its error statuses and codes, and `logprobs` in OpenAI's shape.

OpenAI answers a bad parameter with 400 (the official SDK raises BadRequestError; 422 would be its
UnprocessableEntityError) and a prompt past the context with `context_length_exceeded`; this service's own
endpoints keep 422 and their finer codes. See docs/usage.md, OpenAI-compatible endpoint.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfuse.model_files import DEFAULT, DEFAULT_LLM_NAME
from kvfuse.model_sources import model_id
from kvfuse.service.api.openai_responses import ChoiceLogprobs, TokenLogprob, TopLogprob
from kvfuse.service.errors import APIError
from kvfuse.service.rag.prompt_size import PROMPT_TOO_LONG
from kvfuse.service.wire.protocol import ERR_CONTEXT_OVERFLOW, ERR_MAX_TOKENS

if TYPE_CHECKING:
    from kvfuse.config import Settings
    from kvfuse.service.api.schemas import ChatIn

SERVICE_MODEL_ALIAS = "kvfuse"  # always accepted as `model`, whatever LLM is configured
DEFAULT_LLM_ID = f"HuggingFaceTB/{DEFAULT_LLM_NAME}"  # the default LLM's id on the Hugging Face hub
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
_CONTEXT_CODES = (PROMPT_TOO_LONG, ERR_MAX_TOKENS, ERR_CONTEXT_OVERFLOW)
# Accepted by OpenAI, meaningless for an answer grounded in retrieved documents: refused, never ignored.
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "audio", "prediction")


def model_name(llm: str) -> str:
    """The served model's short name, from the `model.llm` setting."""
    return DEFAULT_LLM_NAME if llm == DEFAULT else Path(llm).name or llm


@functools.lru_cache(maxsize=8)
def full_name(llm: str) -> str:
    """The LLM's full id: the default's hub id, a local folder's own name (the one `kvfuse models prepare`
    recorded, its config's hub id or its model card's: model_sources.model_id), else `llm` as given."""
    if llm == DEFAULT:
        return DEFAULT_LLM_ID
    return model_id(llm) or llm


def served_names(settings: Settings) -> list[str]:
    """Every name a client may send as `model`, the one answers carry first: `model.served_model_name`
    (default: the LLM's full id, `full_name`), its short name, and "kvfuse"."""
    llm = settings.model.llm
    full = settings.model.served_model_name or full_name(llm)
    return list(dict.fromkeys([full, model_name(llm), SERVICE_MODEL_ALIAS]))


def check_request(body: ChatIn, names: list[str]) -> None:
    """400 for parameters this service does not implement (named), 404 for a model it does not serve."""
    extra = body.model_extra or {}
    refused = [k for k in UNSUPPORTED if extra.get(k) not in (None, [], {})]
    fmt = extra.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        refused.append("response_format")
    if refused:
        raise APIError(400, f"unsupported parameter(s): {', '.join(refused)}: this service answers in plain text "
                       "from retrieved documents (no tool calls, no structured output)",
                       code="unsupported_parameter", param=refused[0])
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", code="invalid_value", param="top_logprobs")
    if body.model not in names:
        raise APIError(404, f"model {body.model!r} does not exist; this service serves {', '.join(map(repr, names))}",
                       code="model_not_found", param="model")


def openai_error(err: APIError) -> APIError:
    """The error as OpenAI would state it: 400 where this service says 422, and `context_length_exceeded`
    (param `messages`) for a prompt that cannot fit the context; other errors pass unchanged."""
    if err.code in _CONTEXT_CODES:
        return APIError(400, err.message, code=CONTEXT_LENGTH_EXCEEDED, param="messages", headers=err.headers)
    if err.status == 422:
        return APIError(400, err.message, code=err.code, param=err.param, headers=err.headers)
    return err


def choice_logprobs(tokenizer: Any, entries: list | None) -> ChoiceLogprobs | None:
    """OpenAI's `logprobs` from the worker's [token id, logprob, [[id, logprob], ...]] entries."""
    if entries is None:
        return None

    def top(token_id: int, logprob: float) -> TopLogprob:
        text = tokenizer.decode([token_id])
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    content = [TokenLogprob(**top(t, lp).model_dump(), top_logprobs=[top(i, v) for i, v in best])
               for t, lp, best in entries]
    return ChoiceLogprobs(content=content)
