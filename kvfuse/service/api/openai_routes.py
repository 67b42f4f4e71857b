"""OpenAI-compatible POST /v1/chat/completions and GET /v1/models, usable by the `openai` client unchanged.

The question is the last user message; system/developer messages replace the configured system prompt.
Retrieval and fusion knobs (`top_k`, `document_ids`, `filters`, `fusion`) ride along as extra body
fields. `usage.prompt_tokens_details.cached_tokens` counts the prompt tokens whose stored KV was reused.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from kvfuse.service.api import sse
from kvfuse.service.api.answers import answer_of, sources_of
from kvfuse.service.api.dependencies import Caller, Queries, State
from kvfuse.service.api.errors import ERROR_RESPONSES
from kvfuse.service.api.query_routes import CLIENT_CLOSED, collect_answer, start_query
from kvfuse.service.api.responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatUsage,
    ChunkChoice,
    ChunkDelta,
    ModelCard,
    ModelList,
)
from kvfuse.service.api.schemas import ChatIn, documented_body, parse_json, validate
from kvfuse.service.errors import APIError
from kvfuse.service.rag.query import ClientGone, QueryRun, QueryService

router = APIRouter(responses=ERROR_RESPONSES)
SERVICE_MODEL_ALIAS = "kvfuse"  # always accepted as `model`, whatever LLM is configured


def model_name(llm: str) -> str:
    """The served model's name in OpenAI's `model` field, from the `model.llm` setting."""
    return "SmolLM2-135M-Instruct" if llm == "default" else Path(llm).name or llm


@router.get("/v1/models")
async def models(state: State) -> ModelList:
    created = int(state.started_at)
    names = (model_name(state.settings.model.llm), SERVICE_MODEL_ALIAS)
    return ModelList(data=[ModelCard(id=name, created=created) for name in names])


def _finish(reason: str) -> Literal["stop", "length"]:
    return "length" if reason == "length" else "stop"


@router.post("/v1/chat/completions", response_model=ChatCompletion, openapi_extra=documented_body(ChatIn))
async def chat_completions(request: Request, state: State, queries: Queries, caller: Caller
                           ) -> ChatCompletion | Response:
    """The body is read by hand, as for /v1/query; its schema is `ChatIn`."""
    arrived = time.monotonic()
    body = validate(ChatIn, parse_json(await request.body()))
    name = model_name(state.settings.model.llm)
    if body.model not in (name, SERVICE_MODEL_ALIAS):
        raise APIError(404, f"model {body.model!r} does not exist; this service serves {name!r}",
                       code="model_not_found", param="model")
    users = [m for m in body.messages if m.role == "user"]
    if not users or not users[-1].text().strip():
        raise APIError(422, "messages must contain a non-empty user message", code="invalid_value",
                       param="messages")
    system = "\n".join(m.text() for m in body.messages if m.role in ("system", "developer")) or None
    if body.max_completion_tokens is not None:
        body.max_tokens = body.max_completion_tokens
    try:
        run = await start_query(queries, request, body, caller, question=users[-1].text(), system_prompt=system,
                                arrived=arrived)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    cid = "chatcmpl-" + uuid.uuid4().hex[:24]
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(queries, run, cid, created, name, include_usage), media_type=sse.MEDIA_TYPE,
                                 headers=sse.HEADERS)
    answer = await collect_answer(queries, run, request, what="request")
    if answer is None:
        return Response(status_code=CLIENT_CLOSED)
    choice = ChatChoice(message=AssistantMessage(content=answer.answer), finish_reason=_finish(answer.finish_reason))
    return ChatCompletion(id=cid, created=created, model=name, choices=[choice], usage=ChatUsage.of(answer.usage),
                          sources=answer.sources, dropped_sources=answer.dropped_sources, warning=answer.warning,
                          timings=answer.timings, fusion=answer.fusion)


async def _stream(queries: QueryService, run: QueryRun, cid: str, created: int, name: str,
                  include_usage: bool) -> AsyncIterator[bytes]:
    def chunk(choices: list[ChunkChoice], **extra: object) -> bytes:
        # Only the fields given are sent (exclude_unset): each chunk carries what OpenAI's would, plus ours.
        c = ChatCompletionChunk(id=cid, object="chat.completion.chunk", created=created, model=name, choices=choices,
                                **extra)
        return sse.event(c.model_dump(mode="json", exclude_unset=True))

    def choice(delta: ChunkDelta, finish: Literal["stop", "length"] | None = None) -> list[ChunkChoice]:
        return [ChunkChoice(index=0, delta=delta, finish_reason=finish, logprobs=None)]

    retrieved = sources_of(run)
    yield chunk(choice(ChunkDelta(role="assistant", content="")), sources=retrieved.sources, warning=retrieved.warning)
    try:
        async for kind, p in queries.stream(run):
            if kind == "delta":
                yield chunk(choice(ChunkDelta(content=p["text"])))
            else:
                a = answer_of(run, p)
                yield chunk(choice(ChunkDelta(), _finish(a.finish_reason)), timings=a.timings, fusion=a.fusion)
                if include_usage:
                    yield chunk([], usage=ChatUsage.of(a.usage))
    except APIError as err:
        yield sse.event(err.body())
    yield sse.DONE
