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
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvfuse.service import sse
from kvfuse.service.errors import APIError
from kvfuse.service.query import ClientGone, QueryRun, QueryService
from kvfuse.service.query_api import CLIENT_CLOSED, collect_result, start_query
from kvfuse.service.schemas import ChatIn, parse_json, validate

router = APIRouter()
SERVICE_MODEL_ALIAS = "kvfuse"  # always accepted as `model`, whatever LLM is configured


def model_name(request: Request) -> str:
    llm = request.app.state.kv.settings.model.llm
    return "SmolLM2-135M-Instruct" if llm == "default" else Path(llm).name or llm


@router.get("/v1/models")
async def models(request: Request) -> dict:
    created = int(request.app.state.started_at)
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": created, "owned_by": "kvfuse"}
        for name in (model_name(request), SERVICE_MODEL_ALIAS)]}


def _usage(summary: dict) -> dict:
    u = summary["usage"]
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]},
            "recomputed_tokens": u["recomputed_tokens"]}


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    arrived = time.monotonic()
    body = validate(ChatIn, parse_json(await request.body()))
    name = model_name(request)
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
    qs: QueryService = request.app.state.queries
    try:
        run = await start_query(request, body, question=users[-1].text(), system_prompt=system, arrived=arrived)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    cid = "chatcmpl-" + uuid.uuid4().hex[:24]
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(qs, run, cid, created, name, include_usage), media_type=sse.MEDIA_TYPE,
                                 headers=sse.HEADERS)
    summary = await collect_result(qs, run, request, what="request")
    if summary is None:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse({
        "id": cid, "object": "chat.completion", "created": created, "model": name,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": summary["answer"]},
                     "finish_reason": _finish(summary["finish_reason"]), "logprobs": None}],
        "usage": _usage(summary), "sources": [c.public() for c in run.sources],
        "dropped_sources": [c.public() for c in run.dropped], "warning": run.warning,
        "timings": summary["timings"], "fusion": summary["fusion"]})


async def _stream(qs: QueryService, run: QueryRun, cid: str, created: int, name: str,
                  include_usage: bool) -> AsyncIterator[bytes]:
    def chunk(delta: dict, finish: str | None = None, **extra: Any) -> bytes:
        return sse.event({"id": cid, "object": "chat.completion.chunk", "created": created, "model": name,
                          "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
                          **extra})

    yield chunk({"role": "assistant", "content": ""}, sources=[c.public() for c in run.sources],
                warning=run.warning)
    try:
        async for kind, p in qs.stream(run):
            if kind == "delta":
                yield chunk({"content": p["text"]})
            else:
                yield chunk({}, _finish(p["finish_reason"]), timings=p["timings"], fusion=p["fusion"])
                if include_usage:
                    yield sse.event({"id": cid, "object": "chat.completion.chunk", "created": created,
                                     "model": name, "choices": [], "usage": _usage(p)})
    except APIError as err:
        yield sse.event(err.body())
    yield sse.DONE
