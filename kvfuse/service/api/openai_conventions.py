"""What makes the OpenAI-compatible endpoints read like OpenAI's to their clients: the model names they
answer to, the parameters and content parts they refuse rather than ignore, their error statuses and
codes, and `logprobs` in OpenAI's shapes (chat's and the legacy completions').

OpenAI answers a bad parameter with 400 (the official SDK raises BadRequestError; 422 would be its
UnprocessableEntityError) and a prompt past the context with `context_length_exceeded`; this service's own
endpoints keep 422 and their finer codes. See docs/usage.md, "OpenAI-compatible endpoints".
"""

from __future__ import annotations

import functools
import re
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfuse.model_files import DEFAULT, DEFAULT_LLM_NAME
from kvfuse.model_sources import model_id
from kvfuse.service.api.openai_responses import ChoiceLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from kvfuse.service.api.openai_schemas import TEXT_PARTS
from kvfuse.service.api.openai_structured import response_grammar
from kvfuse.service.errors import APIError
from kvfuse.service.rag.prompt_size import PROMPT_TOO_LONG
from kvfuse.service.wire.protocol import ERR_CONTEXT_OVERFLOW, ERR_MAX_TOKENS

if TYPE_CHECKING:
    from kvfuse.config import Settings
    from kvfuse.service.api.openai_schemas import ChatIn, OpenAIGenerationIn

DEFAULT_EMBEDDER_ID = "sentence-transformers/all-MiniLM-L6-v2"  # the default embedder's id on the hub
SERVICE_MODEL_ALIAS = "kvfuse"  # always accepted as `model`, whatever LLM is configured
DEFAULT_LLM_ID = f"HuggingFaceTB/{DEFAULT_LLM_NAME}"  # the default LLM's id on the Hugging Face hub
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
_CONTEXT_CODES = (PROMPT_TOO_LONG, ERR_MAX_TOKENS, ERR_CONTEXT_OVERFLOW)
# Accepted by OpenAI, meaningless for an answer grounded in retrieved documents: refused, never ignored.
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "audio", "prediction")
LOGIT_BIAS_MAX = 100.0


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


def embedder_names(settings: Settings) -> list[str]:
    """The names `/v1/embeddings` answers to, the one answers carry first: the embedder's full id (the
    hub id of the default, else `model.embedder` as given) and its short name."""
    emb = settings.model.embedder
    full = DEFAULT_EMBEDDER_ID if emb == DEFAULT else emb
    return list(dict.fromkeys([full, Path(full).name or full]))


def check_model(model: str, names: list[str], what: str = "this endpoint") -> None:
    if model not in names:
        raise APIError(404, f"model {model!r} does not exist for {what}; it serves {', '.join(map(repr, names))}",
                       code="model_not_found", param="model")


def check_sampling(body: OpenAIGenerationIn, max_choices: int) -> None:
    """400 naming the field for what OpenAI refuses too (stream_options without stream, a logit_bias key
    that is no token id or a bias past +-100) and for an `n` over `max_choices` (server.max_choices). The
    penalties and biases are applied by the sampler (fusion/engine/sampling.py), to every choice."""
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", code="invalid_value",
                       param="stream_options")
    if body.n > max_choices:
        raise APIError(400, f"n={body.n}: at most {max_choices} choices per request are served "
                       "(server.max_choices)", code="invalid_value", param="n")
    for key, bias in (body.logit_bias or {}).items():
        if not key.isdigit() or not -LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX:
            raise APIError(400, f"logit_bias maps token ids to biases in [-100, 100]; got {key!r}: {bias}",
                           code="invalid_value", param="logit_bias")
    knobs = [k for k in ("document_ids", "filters", "retrieval", "top_k") if getattr(body, k, None) is not None]
    if not body.use_retrieval and knobs:
        raise APIError(400, f"use_retrieval: false uses no documents: {', '.join(knobs)} cannot be given with it",
                       code="invalid_value", param="use_retrieval")


def choices_of(text: str, finish_reason: str, run: Any) -> list[tuple[int, str, str, list | None]]:
    """(index, text, finish_reason, logprob entries) of every choice of a finished run: choice 0's from
    its answer, the others' (n > 1) from the worker's Result (rag/query.py QueryRun.choices)."""
    return [(0, text, finish_reason, run.logprobs),
            *((c["index"], c["text"], c["finish_reason"], c["logprobs"]) for c in run.choices)]


def check_logit_bias(body: OpenAIGenerationIn, vocab: int) -> dict[int, float]:
    """The request's logit_bias with int keys, each a token id of the served model (400 otherwise: the
    ids are the model's own, not OpenAI's tokenizer's)."""
    bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
    bad = sorted(t for t in bias if t >= vocab)
    if bad:
        raise APIError(400, f"logit_bias names token ids {bad} outside the model's vocabulary (0..{vocab - 1})",
                       code="invalid_value", param="logit_bias")
    return bias


def check_content_parts(body: ChatIn) -> None:
    """400 naming `messages[i].content[j].type` for a part this text-only model cannot read (image_url,
    input_audio, file): refused, not dropped, so an answer never silently misses what was sent."""
    for i, m in enumerate(body.messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            kind = part.get("type")
            if kind not in TEXT_PARTS:
                raise APIError(400, f"content part of type {kind!r} cannot be read: the model reads text only "
                               f"(parts of type {', '.join(map(repr, TEXT_PARTS))})", code="unsupported_content",
                               param=f"messages[{i}].content[{j}].type")
            if not isinstance(part.get("text"), str):
                raise APIError(400, "a text content part needs a string `text`", code="invalid_value",
                               param=f"messages[{i}].content[{j}].text")


def check_request(body: ChatIn, names: list[str], max_choices: int) -> None:
    """A chat request: 400 for parameters this service does not implement (named) and for a
    `response_format` it cannot follow (openai_structured.py), 404 for a model it does not serve."""
    extra = body.model_extra or {}
    refused = [k for k in UNSUPPORTED if extra.get(k) not in (None, [], {})]
    if refused:
        raise APIError(400, f"unsupported parameter(s): {', '.join(refused)}: this service answers from retrieved "
                       "documents (no tool calls)",
                       code="unsupported_parameter", param=refused[0])
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", code="invalid_value", param="top_logprobs")
    check_sampling(body, max_choices)
    check_content_parts(body)
    check_model(body.model, names, "chat completions")
    body._grammar = response_grammar(body.response_format)


def _routes(routes: list[Any]) -> list[tuple[str, set[str]]]:
    """(path, methods) of every route, through included routers (FastAPI keeps those as wrappers)."""
    found: list[tuple[str, set[str]]] = []
    for r in routes:
        if hasattr(r, "original_router"):
            found.extend(_routes(r.original_router.routes))
        elif getattr(r, "path", None):
            found.append((re.sub(r":\w+}", "}", r.path), set(getattr(r, "methods", None) or ())))
    return found


def unknown_path(request: Any) -> APIError:
    """404 for a path under /v1/ that no route serves, as OpenAI words it ("Invalid URL (GET /v1/x)"),
    listing the endpoints this service serves, from the app's own routes."""
    served = sorted({f"{m} {path}" for path, methods in _routes(request.app.routes) if path.startswith("/v1/")
                     for m in methods if m != "HEAD"}, key=lambda e: (e.split(" ")[1], e))
    return APIError(404, f"Invalid URL ({request.method} {request.url.path}): this service serves "
                    f"{', '.join(served)}", code="not_found")


def openai_error(err: APIError, param: str = "messages") -> APIError:
    """The error as OpenAI would state it: 400 where this service says 422, and `context_length_exceeded`
    (naming `param`, the field that holds the prompt) for a prompt that cannot fit the context; other
    errors pass unchanged."""
    if err.code in _CONTEXT_CODES:
        return APIError(400, err.message, code=CONTEXT_LENGTH_EXCEEDED, param=param, headers=err.headers)
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


def completion_logprobs(tokenizer: Any, entries: list | None, start: int = 0) -> CompletionLogprobs | None:
    """The legacy endpoint's `logprobs`: parallel lists of tokens, their log-probabilities, a {token:
    logprob} map of the alternatives of each, and each token's character offset in the text (the first
    at `start`: a streamed piece's place in the whole)."""
    if entries is None:
        return None
    tokens = [tokenizer.decode([t]) for t, _, _ in entries]
    offsets = list(accumulate((len(t) for t in tokens[:-1]), initial=start))[:len(tokens)]
    return CompletionLogprobs(tokens=tokens, token_logprobs=[lp for _, lp, _ in entries],
                              top_logprobs=[{tokenizer.decode([i]): v for i, v in best} for _, _, best in entries],
                              text_offset=offsets)
