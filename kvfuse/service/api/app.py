"""The FastAPI app: `create_app(settings)`.

The lifespan creates the `ServiceState` (routes get it through dependencies.py), starts the worker
process (which loads the LLM) and, in the background, opens the store, the vector index, the embedder and
the tokenizer-only chunker in this process; `/ready` answers 503 until all of them are up. This process
never loads the LLM.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvfuse import __version__
from kvfuse.config import ConfigError, Settings, setting_error
from kvfuse.service.api import (
    document_routes,
    openai_completions,
    openai_embeddings,
    openai_routes,
    query_routes,
    search_routes,
    warmup_routes,
)
from kvfuse.service.api.auth import KeyRing, presented_key, request_principal
from kvfuse.service.api.concurrency import ConcurrencyMiddleware
from kvfuse.service.api.dependencies import State
from kvfuse.service.api.errors import install_error_handlers
from kvfuse.service.api.middleware import GuardMiddleware
from kvfuse.service.api.openai_schemas import OPENAI_BODY_MODELS
from kvfuse.service.api.responses import Health, Readiness
from kvfuse.service.api.schemas import BODY_MODELS, add_body_schemas
from kvfuse.service.errors import ErrorBody, error_body
from kvfuse.service.health import OK
from kvfuse.service.state import ServiceState


def check_settings(settings: Settings) -> None:
    """Refuse settings only the service can judge, before anything loads: raises ConfigError (the CLI
    prints it and exits 2) rather than a service that starts and then refuses every query that relies on
    the default."""
    from kvfuse.fusion import available_methods

    methods = available_methods()
    if settings.fusion.method not in methods:
        raise setting_error(("fusion", "method"), f"unknown fusion method; available: {', '.join(methods)}",
                            settings.fusion.method)


def create_app(settings: Settings) -> FastAPI:
    check_settings(settings)
    try:
        keys = KeyRing.of(settings)
    except ValueError as err:
        raise ConfigError(f"invalid kvfuse configuration: {err}") from None

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
    app.add_middleware(GuardMiddleware, server=settings.server, keys=keys)
    app.add_middleware(ConcurrencyMiddleware, server=settings.server)  # outermost: counted before anything
    app.include_router(document_routes.router)
    app.include_router(warmup_routes.router)
    app.include_router(query_routes.router)
    app.include_router(search_routes.router)
    app.include_router(openai_routes.router)
    app.include_router(openai_completions.router)
    app.include_router(openai_embeddings.router)
    fastapi_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = add_body_schemas(fastapi_openapi(), BODY_MODELS + OPENAI_BODY_MODELS)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    add_probes(app, settings, keys)
    return app


def add_probes(app: FastAPI, settings: Settings, keys: KeyRing) -> None:
    """/health, /ready and /metrics: open to the orchestrator, with details only for a valid key."""

    def authorized(request: Request) -> bool:
        """Whether the open probes may show details (no keys set, or a valid key presented)."""
        return not keys.enabled or keys.principal(presented_key(request)) is not None

    not_healthy = {"model": Health, "description": "starting, or failed for good (kvfuse/service/health.py)"}

    @app.get("/health", response_model=Health, responses={503: not_healthy})
    async def health(state: State, request: Request) -> Health | JSONResponse:
        # 200 only once ready, and through transient outages after that; 503 while starting or failed.
        status, reason = state.health()
        body = Health.of(__version__, status, reason, state.dispatcher, details=authorized(request))
        if status == OK:
            return body
        return JSONResponse(body.model_dump(), status_code=503)

    not_ready = {"model": ErrorBody, "description": "not ready: the error, beside the Readiness fields"}

    @app.get("/ready", response_model=Readiness, responses={503: not_ready})
    async def ready(state: State, request: Request) -> Readiness | JSONResponse:
        # The live workers name hosts and pids: like errors, only for a valid key.
        workers = state.dispatcher.live_workers() if authorized(request) else []
        parts = Readiness(ready=False, components=state.readiness(await state.document_index_available()),
                          workers=workers)
        if all(parts.components.values()) and not state.startup_error:
            parts.ready = True
            return parts
        missing = ", ".join(k for k, ok in parts.components.items() if not ok)
        reason = state.not_ready_reason(parts.components)
        if not authorized(request):  # errors may name hosts and ports: only for a valid key
            reason = f"waiting for: {missing}" if missing else "the service failed to start"
        body = error_body(503, f"not ready: {reason}", code="not_ready")
        return JSONResponse({**body, **parts.model_dump()}, status_code=503)

    @app.get("/metrics", response_class=Response)
    async def metrics(state: State, request: Request) -> Response:
        # Service-wide counts (documents, chunks, queries): public only by the operator's choice, else
        # for a key that sees every collection (auth.py, Principal.check_every_collection).
        if not settings.server.metrics_public:
            request_principal(request).check_every_collection("the metrics (counts over every collection)")
        state.refresh_document_gauge()
        workers = state.dispatcher.live_workers()
        state.metrics.live_workers.set(len(workers))
        state.metrics.worker_load.clear()
        for w in workers:
            state.metrics.worker_load.labels(w["id"]).set((w.get("running") or 0) + (w.get("waiting") or 0))
            if w.get("kv_budget_bytes") is not None:  # a fleet worker's, from its heartbeat
                state.metrics.kv_pool_bytes.labels(w["id"]).set(w.get("kv_pool_bytes") or 0)
                state.metrics.kv_budget_bytes.labels(w["id"]).set(w["kv_budget_bytes"])
                if w.get("kv_ledger"):
                    state.metrics.ledger(w["id"], w["kv_ledger"])
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
