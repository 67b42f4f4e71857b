"""OpenAI-compatible `POST /v1/completions` (the legacy endpoint LlamaIndex's OpenAILike and
litellm.text_completion call): the prompt is the question, answered through the same retrieval and fusion
as /v1/chat/completions, as JSON or streamed.

`use_retrieval: false` (an extra body field) answers from the prompt alone, with no documents: LlamaIndex's
completion mode sends a prompt that already holds its context. The prompt still goes into the model's
chat template with the system prompt (`system_prompt` as in /v1/query): `echo` (the prompt's own tokens
back) has no meaning there and is refused, as are `suffix` (no fill-in-the-middle), `best_of` > 1 and
`response_format` (chat's; OpenAI's legacy endpoint has none).
`logprobs: k` returns the legacy shape: each token's log-probability and its k best alternatives.
docs/usage.md, "OpenAI-compatible endpoints".
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvfuse.service.api import sse
from kvfuse.service.api.answers import answer_of, sources_of
from kvfuse.service.api.auth import Principal
from kvfuse.service.api.dependencies import Caller, Queries, State
from kvfuse.service.api.errors import ERROR_RESPONSES
from kvfuse.service.api.openai_conventions import (
    check_logit_bias,
    check_model,
    check_sampling,
    choices_of,
    completion_logprobs,
    openai_error,
    served_names,
)
from kvfuse.service.api.openai_responses import ChatUsage, CompletionChoice, TextCompletion
from kvfuse.service.api.openai_routes import start_openai_query
from kvfuse.service.api.openai_schemas import CompletionIn
from kvfuse.service.api.query_routes import CLIENT_CLOSED, collect_answer
from kvfuse.service.api.schemas import documented_body, parse_json, validate
from kvfuse.service.errors import APIError
from kvfuse.service.rag.query import ClientGone, QueryRun, QueryService

router = APIRouter(responses=ERROR_RESPONSES)


@dataclass
class _Sampling:
    """The knobs as QueryService.generation_options reads them (chat's `logprobs`/`top_logprobs`)."""

    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    stop: str | list[str] | None
    seed: int | None
    logprobs: bool
    top_logprobs: int | None
    logit_bias: dict[int, float]
    presence_penalty: float | None
    frequency_penalty: float | None


def _prompt(body: CompletionIn) -> str:
    """The one prompt, after refusing what this endpoint does not do (400 naming the field)."""
    refused = [name for name, on in (("echo", body.echo), ("suffix", bool(body.suffix)),
                                     ("best_of", (body.best_of or 1) > 1),
                                     ("response_format", (body.model_extra or {}).get("response_format") is not None))
               if on]
    if refused:
        raise APIError(400, f"unsupported parameter(s): {', '.join(refused)}: the prompt is answered in the "
                       "model's chat template (no echo of its tokens, no fill-in-the-middle suffix), one "
                       "completion is decoded (best_of 1), and structured answers are chat's (response_format)", code="unsupported_parameter", param=refused[0])
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if len(prompts) != 1:
        raise APIError(400, f"prompt holds {len(prompts)} prompts; one prompt per request is served",
                       code="invalid_value", param="prompt")
    if not prompts[0].strip():
        raise APIError(400, "prompt is empty or whitespace only", code="invalid_value", param="prompt")
    return prompts[0]


def _finish(reason: str) -> Literal["stop", "length"]:
    return "length" if reason == "length" else "stop"


@router.post("/v1/completions", response_model=TextCompletion, openapi_extra=documented_body(CompletionIn))
async def completions(request: Request, state: State, queries: Queries, caller: Caller) -> TextCompletion | Response:
    """The body is read by hand, as for /v1/query; its schema is `CompletionIn`. Errors in OpenAI's
    statuses."""
    try:
        return await _complete(request, state, queries, caller)
    except APIError as err:
        raise openai_error(err, param="prompt") from None


async def _complete(request: Request, state: Any, queries: QueryService, caller: Principal
                    ) -> TextCompletion | Response:
    arrived = time.monotonic()
    body = validate(CompletionIn, parse_json(await request.body()))
    names = served_names(state.settings)
    check_sampling(body, state.settings.server.max_choices)
    prompt = _prompt(body)
    check_model(body.model, names, "completions")
    gen = _Sampling(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p, stop=body.stop,
                    seed=body.seed, logprobs=body.logprobs is not None, top_logprobs=body.logprobs,
                    logit_bias=check_logit_bias(body, len(state.corpus.chunker.tokenizer)),
                    presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty)
    try:
        run = await start_openai_query(queries, request, body, caller, gen=gen, question=prompt,
                                       system_prompt=body.system_prompt, arrived=arrived)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    head = {"id": "cmpl-" + uuid.uuid4().hex[:24], "created": int(time.time()), "model": names[0]}
    tokenizer = state.corpus.chunker.tokenizer
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse.stream(_stream(queries, run, head, include_usage, tokenizer), state.settings.server.sse_ping_s)
    answer = await collect_answer(queries, run, request, what="request")
    if answer is None:
        return Response(status_code=CLIENT_CLOSED)
    choices = [CompletionChoice(text=text, index=i, finish_reason=_finish(reason),
                                logprobs=completion_logprobs(tokenizer, entries))
               for i, text, reason, entries in choices_of(answer.answer, answer.finish_reason, run)]
    return TextCompletion(**head, choices=choices, usage=ChatUsage.of(answer.usage), sources=answer.sources,
                          dropped_sources=answer.dropped_sources, warning=answer.warning, timings=answer.timings,
                          fusion=answer.fusion)


async def _stream(queries: QueryService, run: QueryRun, head: dict, include_usage: bool, tokenizer: Any
                  ) -> AsyncIterator[bytes]:
    def event(choices: list[CompletionChoice], **extra: object) -> bytes:
        # Only the fields given are sent (exclude_unset): each event carries what OpenAI's would, plus ours.
        c = TextCompletion(**head, object="text_completion", choices=choices, **extra)
        return sse.event(c.model_dump(mode="json", exclude_unset=True))

    def choice(text: str, finish: Literal["stop", "length"] | None, entries: list | None, at: int, index: int = 0
               ) -> list[CompletionChoice]:
        return [CompletionChoice(text=text, index=index, finish_reason=finish,
                                 logprobs=completion_logprobs(tokenizer, entries, at))]

    # Each event carries one choice (OpenAI's shape for n > 1), its index naming it.
    retrieved = sources_of(run)
    yield event(choice("", None, None, 0), sources=retrieved.sources, warning=retrieved.warning)
    n = run.plan.n
    sent, chars = [0] * n, [0] * n  # per choice: tokens whose logprobs went out with their text; characters sent
    try:
        async for kind, p in queries.stream(run):
            if kind == "delta":
                i = p["index"]
                yield event(choice(p["text"], None, p["logprobs"], chars[i], i))
                sent[i] += len(p["logprobs"] or [])
                chars[i] += len(p["text"])
            else:
                a = answer_of(run, p)
                for i, _, reason, entries in choices_of(a.answer, a.finish_reason, run):
                    rest = None if entries is None else entries[sent[i]:]
                    yield event(choice("", _finish(reason), rest, chars[i], i), timings=a.timings, fusion=a.fusion)
                if include_usage:
                    yield event([], usage=ChatUsage.of(a.usage))
    except APIError as err:
        yield sse.event(openai_error(err, param="prompt").body())
    yield sse.DONE
