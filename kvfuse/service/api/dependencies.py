"""What a route may ask FastAPI for: the service's state, its query pipeline and the caller's key.

Routes declare a parameter of one of these types instead of reaching into `request.app.state`, so what a
route depends on is in its signature (and a test app could override it with `dependency_overrides`).
`ReadyState` also answers 503 while the store, index and embedder are still loading: a route that needs
them cannot forget the check.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from kvfuse.service.api.auth import Principal, request_principal
from kvfuse.service.rag.query import QueryService
from kvfuse.service.state import ServiceState


def service_state(request: Request) -> ServiceState:
    """The state the app's lifespan created (see app.py)."""
    return request.app.state.service


def ready_state(state: Annotated[ServiceState, Depends(service_state)]) -> ServiceState:
    state.require_components()
    return state


def model_state(state: Annotated[ServiceState, Depends(ready_state)]) -> ServiceState:
    """The state for a route that needs the model: 503 `model_failed` once it can never serve."""
    state.require_model()
    return state


def query_service(state: Annotated[ServiceState, Depends(model_state)]) -> QueryService:
    """The query pipeline, once the store, index and embedder are loaded (503 until then) and while the
    model can serve (503 model_failed once it never will)."""
    return state.queries


State = Annotated[ServiceState, Depends(service_state)]
ReadyState = Annotated[ServiceState, Depends(ready_state)]
ModelState = Annotated[ServiceState, Depends(model_state)]
Queries = Annotated[QueryService, Depends(query_service)]
# The caller's API key: what it may see and change (auth.py). A route takes `caller: Caller` and applies it
# where it picks collections or documents: caller.check_document(id, rec.collection), caller.check_write(coll),
# caller.visible(names), or `visible=caller.allowed_collections` for a search.
Caller = Annotated[Principal, Depends(request_principal)]
