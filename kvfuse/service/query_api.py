"""POST /v1/query: JSON answer or an SSE stream (sources, token deltas, final usage/timings, [DONE])."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvfuse.service import sse
from kvfuse.service.errors import APIError
from kvfuse.service.query import ClientGone, QueryRun, QueryService
from kvfuse.service.schemas import QueryIn, parse_json, validate

router = APIRouter()
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, the access log does


async def watch_disconnect(agen: AsyncIterator[Any], request: Request) -> AsyncIterator[Any]:
    """Items of `agen`; raises ClientGone as soon as the client disconnects (checked while waiting)."""
    while True:
        nxt = asyncio.ensure_future(anext(agen))
        while True:
            done, _ = await asyncio.wait({nxt}, timeout=0.25)
            if done:
                break
            if await request.is_disconnected():
                nxt.cancel()  # the generator's cleanup cancels the worker job
                await asyncio.gather(nxt, return_exceptions=True)
                raise ClientGone()
        try:
            yield nxt.result()
        except StopAsyncIteration:
            return


def sources_payload(run: QueryRun) -> dict[str, Any]:
    return {"sources": [c.public() for c in run.sources], "dropped_sources": [c.public() for c in run.dropped],
            "warning": run.warning, "fusion": {"method": run.plan.fusion["method"],
                                               "recompute_ratio": run.plan.fusion["recompute_ratio"]}}


async def start_query(request: Request, body: Any, *, question: str, system_prompt: str | None,
                      arrived: float) -> QueryRun:
    qs: QueryService = request.app.state.queries
    plan = await qs.prepare(question=question, system_prompt=system_prompt, top_k=body.top_k,
                            document_ids=body.document_ids, filters=body.filters, fusion=body.fusion, gen=body,
                            arrived=arrived)
    return await qs.start(plan, request)


@router.post("/v1/query")
async def query(request: Request) -> Response:
    arrived = time.monotonic()
    body = validate(QueryIn, parse_json(await request.body()))
    qs: QueryService = request.app.state.queries
    try:
        run = await start_query(request, body, question=body.query, system_prompt=body.system_prompt,
                                arrived=arrived)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    if body.stream:
        return StreamingResponse(_sse(qs, run), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
    result = await collect_result(qs, run, request, what="query")
    if result is None:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse({**sources_payload(run), **result})


async def collect_result(qs: QueryService, run: QueryRun, request: Request, *, what: str) -> dict[str, Any] | None:
    """A non-streamed run's final result; None if the client left (nobody to answer)."""
    result: dict[str, Any] = {}
    try:
        async for kind, p in watch_disconnect(qs.stream(run), request):
            if kind == "result":
                result = p
    except ClientGone:
        return None
    if not result:
        raise APIError(503, f"the {what} was cancelled", code="cancelled")
    return result


async def _sse(qs: QueryService, run: QueryRun) -> AsyncIterator[bytes]:
    yield sse.event(sources_payload(run), "sources")
    try:
        async for kind, p in qs.stream(run):
            if kind == "delta":
                yield sse.event({"text": p["text"]}, "token")
            else:
                yield sse.event({k: p[k] for k in ("finish_reason", "usage", "timings", "fusion")}, "done")
    except APIError as err:
        yield sse.event({**err.body(), "status": err.status}, "error")
    yield sse.DONE
