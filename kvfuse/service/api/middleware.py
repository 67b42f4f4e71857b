"""ASGI guard in front of every route: API-key check, then the body's encoding (415 unless identity),
then the request body size limit (413), then an ingestion's admission (429 `ingest_queue_full`, and
`parsers_busy` for a file upload) while its queue or the parse processes are full.

The admission check is the routes' own (document_routes.py and uploads.py ask it again): asked here, a
flood's refused ingestion skips FastAPI's routing, its dependencies (run in the thread pool) and query
validation. Measured, that saving is within the noise of what uvicorn's HTTP handling costs a refusal,
about a millisecond of CPU (docs/DESIGN.md, "Bounded under load"; docs/results/overload)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvfuse.config import ServerSettings
from kvfuse.service.api.auth import KeyRing, check_request, client_key
from kvfuse.service.api.errors import error_response
from kvfuse.service.errors import APIError

DOCUMENTS_PATH = "/v1/documents"  # the one route whose admission is checked here


class GuardMiddleware:
    def __init__(self, app: ASGIApp, server: ServerSettings, keys: KeyRing) -> None:
        self.app = app
        self.server = server
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        limit = self.server.max_body_bytes
        try:
            check_request(request, self.keys, self.server)
            check_encoding(request)
            declared = request.headers.get("content-length")
            if declared is not None and (not declared.isdigit() or int(declared) > limit):
                raise _too_large(limit)
            check_admission(scope, request)
        except APIError as err:
            await error_response(err)(scope, receive, send)
            return

        received = 0

        async def limited_receive() -> Message:
            # Chunked uploads declare no length: count as the body arrives and stop at the limit.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _too_large(limit)
            return message

        await self.app(scope, limited_receive, send)


def check_admission(scope: Scope, request: Request) -> None:
    """For POST /v1/documents once the service is up: the 429s the route would answer before reading the
    body, in the same order (the key's room in the ingestion queue, then, for a file, a parse process's)."""
    if scope["method"] != "POST" or scope["path"] != DOCUMENTS_PATH:
        return
    state = getattr(scope["app"].state, "service", None) if "app" in scope else None
    if state is None:
        return
    state.require_components()  # the route's dependencies first (ModelState): 503 while starting,
    state.require_model()  # and once the model can never serve
    state.ingest.check_room(client_key(request))
    if request.headers.get("content-type", "").split(";")[0].strip().lower() == "multipart/form-data":
        state.parsers.check_room()


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds {limit} bytes (server.max_body_bytes)", code="body_too_large")


def check_encoding(request: Request) -> None:
    """Bodies are read as sent: a compressed one (Content-Encoding: gzip, ...) would otherwise reach the
    JSON parser as bytes and be misreported as bad UTF-8. RFC 9110: 415, naming what is accepted."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise APIError(415, f"unsupported Content-Encoding {encoding!r}: send the body uncompressed",
                       code="unsupported_content_encoding", headers={"Accept-Encoding": "identity"})
