"""The FastAPI app: `create_app(settings)`.

The lifespan starts the worker process (which loads the LLM) and, in the background, opens the store,
the vector index, the embedder and the tokenizer-only chunker in this process; `/ready` answers 503
until all of them are up. This process never loads the LLM.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvfuse import __version__
from kvfuse.config import Settings
from kvfuse.service import documents_api, openai_api, query_api
from kvfuse.service.errors import error_body, install_error_handlers
from kvfuse.service.middleware import GuardMiddleware
from kvfuse.service.query import QueryService
from kvfuse.service.state import ServiceState


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = ServiceState(settings)
        app.state.kv = state
        app.state.queries = QueryService(state)
        app.state.started_at = time.time()
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="kvfuse", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, server=settings.server)
    app.include_router(documents_api.router)
    app.include_router(query_api.router)
    app.include_router(openai_api.router)

    @app.get("/health")
    async def health(request: Request) -> dict:
        st: ServiceState = request.app.state.kv
        sup = st.supervisor
        return {"status": "ok", "version": __version__, "worker": {
            "pid": sup.pid, "ready": sup.ready, "restarts": sup.restarts, "last_error": sup.last_error}}

    @app.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        st: ServiceState = request.app.state.kv
        parts = st.readiness()
        if all(parts.values()) and not st.startup_error:
            return JSONResponse({"ready": True, "components": parts})
        missing = ", ".join(k for k, ok in parts.items() if not ok)
        reason = st.startup_error or st.supervisor.last_error or f"waiting for: {missing}"
        body = error_body(503, f"not ready: {reason}", code="not_ready")
        return JSONResponse({**body, "ready": False, "components": parts}, status_code=503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        st: ServiceState = request.app.state.kv
        st.refresh_document_gauge()
        return Response(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
