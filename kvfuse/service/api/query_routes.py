"""POST /v1/query: a JSON answer (`QueryAnswer`) or an SSE stream: a `sources` event (`QuerySources`),
`token` events, a `done` event (the same `QueryAnswer`), then `data: [DONE]`. GET /v1/fidelity: what the
shadow checks measured and the ratios held (rag/fidelity.py). DELETE /v1/query-log: empties the log of
answered queries (rag/query_log.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvfuse.service.api import sse
from kvfuse.service.api.answers import answer_of, sources_of
from kvfuse.service.api.auth import Principal
from kvfuse.service.api.dependencies import Caller, Queries, State
from kvfuse.service.api.errors import ERROR_RESPONSES
from kvfuse.service.api.responses import QueryAnswer
from kvfuse.service.api.schemas import QueryIn, documented_body, parse_json, validate
from kvfuse.service.errors import APIError
from kvfuse.service.rag.query import ClientGone, QueryRun, QueryService, next_unless_gone

router = APIRouter(responses=ERROR_RESPONSES)
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, the access log does
_STREAM_DOC = {200: {"description": "a QueryAnswer, or with `stream: true` server-sent events",
                     "content": {sse.MEDIA_TYPE: {"schema": {"type": "string"}}}}}


async def watch_disconnect(agen: AsyncIterator[Any], request: Request) -> AsyncIterator[Any]:
    """Items of `agen`; raises ClientGone as soon as the client disconnects (checked while waiting)."""
    while True:
        try:
            item = await next_unless_gone(agen, request.is_disconnected)
        except StopAsyncIteration:
            return
        yield item


async def start_query(queries: QueryService, request: Request, body: Any, caller: Principal, *, question: str,
                      system_prompt: str | None, arrived: float, turns: list[tuple[str, str]] | None = None
                      ) -> QueryRun:
    """Plan and queue a query, retrieving only from what the caller's key sees."""
    plan = await queries.prepare(question=question, system_prompt=system_prompt, top_k=body.top_k,
                                 document_ids=body.document_ids, filters=body.filters, retrieval=body.retrieval,
                                 fusion=body.fusion, gen=body, arrived=arrived, turns=turns,
                                 visible=caller.allowed_collections)
    return await queries.start(plan, request.is_disconnected)


@router.post("/v1/query", response_model=QueryAnswer, responses=_STREAM_DOC, openapi_extra=documented_body(QueryIn))
async def query(request: Request, queries: Queries, caller: Caller) -> QueryAnswer | Response:
    """The body is read by hand (not declared) so that malformed JSON, bad UTF-8 and wrong types get this
    service's error codes; its schema is `QueryIn`."""
    arrived = time.monotonic()
    body = validate(QueryIn, parse_json(await request.body()))
    try:
        run = await start_query(queries, request, body, caller, question=body.query, system_prompt=body.system_prompt,
                                arrived=arrived)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    if body.stream:
        return sse.stream(_sse(queries, run), queries.settings.server.sse_ping_s)
    answer = await collect_answer(queries, run, request, what="query")
    return Response(status_code=CLIENT_CLOSED) if answer is None else answer


async def collect_answer(queries: QueryService, run: QueryRun, request: Request, *, what: str
                         ) -> QueryAnswer | None:
    """A non-streamed run's answer; None if the client left (nobody to answer)."""
    answer: QueryAnswer | None = None
    try:
        async for kind, p in watch_disconnect(queries.stream(run), request):
            if kind == "result":
                answer = answer_of(run, p)
    except ClientGone:
        return None
    if answer is None:
        raise APIError(503, f"the {what} was cancelled", code="cancelled")
    return answer


async def _sse(queries: QueryService, run: QueryRun) -> AsyncIterator[bytes]:
    yield sse.event(sources_of(run), "sources")
    try:
        async for kind, p in queries.stream(run):
            if kind == "delta":
                yield sse.event({"text": p["text"]}, "token")
            else:
                yield sse.event(answer_of(run, p), "done")
    except APIError as err:
        yield sse.event({**err.body(), "status": err.status}, "error")
    yield sse.DONE


@router.get("/v1/fidelity")
async def fidelity(state: State, caller: Caller) -> dict[str, Any]:
    """Per method: fused answers shadow-checked against a full prefill, their agreement with its 95 %
    Wilson interval, the mean answer KL, and per prompt-size bucket the ratio held for the target
    (docs/usage.md, "The quality contract"). The checks are of every collection's queries and kept per
    method and prompt size only (a check carries no collection), so they tell how much and what other
    collections ask: a key that sees every collection only. A scoped key's own answers name the ratio
    and bucket they were served at."""
    caller.check_every_collection("the fidelity figures (checks of every collection's queries)")
    return state.fidelity.report()


@router.delete("/v1/query-log")
async def clear_query_log(state: State, caller: Caller) -> dict[str, Any]:
    """Empty the query log (`fidelity.query_log`): it holds users' questions. Needs a write key that sees
    every collection; answers the entries dropped."""
    caller.check_admin("emptying the query log")
    return {"deleted": await asyncio.wrap_future(state.query_log.clear())}
