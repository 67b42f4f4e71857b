"""ASGI guard in front of everything: at most `server.max_concurrent_requests` requests are answered at
once; one more is answered 429 `server_busy` with Retry-After, in the service's error shape, before any
of its body is read.

Every request the API answers holds memory while it runs (its body, its prepared query, its stream), and
before this nothing bounded how many did: uvicorn takes every connection it is offered. The probes
(/health, /ready, /metrics) are not counted and never refused, so an orchestrator sees a busy service as
alive. Behind this, uvicorn holds at most `server.max_connections` connections (its `limit_concurrency`,
set by `kvfuse serve`), answering its own plain 503 past them. See docs/DESIGN.md, "Bounded under load".
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from kvfuse.config import ServerSettings
from kvfuse.service.api.auth import METRICS_PATH, OPEN_PATHS
from kvfuse.service.api.errors import error_response
from kvfuse.service.errors import APIError

_UNCOUNTED = OPEN_PATHS | {METRICS_PATH}


class ConcurrencyMiddleware:
    def __init__(self, app: ASGIApp, server: ServerSettings) -> None:
        self.app = app
        self.limit = server.max_concurrent_requests
        self.retry_after_s = max(1, server.retry_after_s)
        self.running = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in _UNCOUNTED:
            await self.app(scope, receive, send)
            return
        if self.running >= self.limit:
            err = APIError(429, f"the server is answering {self.running} requests, its limit "
                                "(server.max_concurrent_requests); retry later", code="server_busy",
                           headers={"Retry-After": str(self.retry_after_s)})
            await error_response(err)(scope, receive, send)
            return
        self.running += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.running -= 1
