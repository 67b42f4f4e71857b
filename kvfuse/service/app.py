"""The FastAPI app: `create_app(settings)`.

The lifespan creates the `ServiceState` (routes get it through dependencies.py), starts the worker
process (which loads the LLM) and, in the background, opens the store, the vector index, the embedder and
the tokenizer-only chunker in this process; `/ready` answers 503 until all of them are up. This process
never loads the LLM.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvfuse import __version__
from kvfuse.config import Settings
from kvfuse.service import documents_api, openai_api, query_api
from kvfuse.service.dependencies import State
from kvfuse.service.dispatch import live_workers
from kvfuse.service.errors import ErrorBody, error_body, install_error_handlers
from kvfuse.service.middleware import GuardMiddleware
from kvfuse.service.responses import Health, Readiness
from kvfuse.service.schemas import add_body_schemas
from kvfuse.service.state import ServiceState


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = ServiceState(settings)
        app.state.service = state
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
    fastapi_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = add_body_schemas(fastapi_openapi())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/health")
    async def health(state: State) -> Health:
        return Health.of(__version__, state.supervisor)

    not_ready = {"model": ErrorBody, "description": "not ready: the error, beside the Readiness fields"}

    @app.get("/ready", response_model=Readiness, responses={503: not_ready})
    async def ready(state: State) -> Readiness | JSONResponse:
        parts = Readiness(ready=False, components=state.readiness(), workers=live_workers(state.supervisor))
        if all(parts.components.values()) and not state.startup_error:
            parts.ready = True
            return parts
        missing = ", ".join(k for k, ok in parts.components.items() if not ok)
        reason = state.startup_error or state.supervisor.last_error or f"waiting for: {missing}"
        body = error_body(503, f"not ready: {reason}", code="not_ready")
        return JSONResponse({**body, **parts.model_dump()}, status_code=503)

    @app.get("/metrics", response_class=Response)
    async def metrics(state: State) -> Response:
        state.refresh_document_gauge()
        workers = live_workers(state.supervisor)
        state.metrics.live_workers.set(len(workers))
        state.metrics.worker_load.clear()
        for w in workers:
            state.metrics.worker_load.labels(w["id"]).set((w.get("running") or 0) + (w.get("waiting") or 0))
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
