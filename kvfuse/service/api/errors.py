"""Errors as HTTP answers: every `APIError` and FastAPI's own errors (validation, 404 routes, 405,
unreadable bodies), the store's outages and anything unexpected, in the one error shape of
kvfuse/service/errors.py.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvfuse.service.errors import APIError, ErrorBody

log = logging.getLogger(__name__)

# For the OpenAPI schema: routers declare that any 4xx/5xx answer has the error shape.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorBody, "description": "the request was refused"},
    "5XX": {"model": ErrorBody, "description": "the service could not answer"},
}



def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _loc_param(loc: tuple | list) -> str | None:
    # ("body", "fusion", "method") -> "fusion.method"; the first element only says where it came from.
    parts = [str(p) for p in loc[1:]] if loc and loc[0] in ("body", "query", "path", "header") else list(map(str, loc))
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    kind = first.get("type", "")
    if kind == "json_invalid":
        # Malformed JSON and non-UTF-8 bodies are the client's syntax error, not a schema mismatch.
        return APIError(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}",
                        code="invalid_json")
    details = "; ".join(f"{_loc_param(e.get('loc', ())) or 'body'}: {e.get('msg')}" for e in errors[:5])
    return APIError(422, details or "invalid request", code="invalid_value", param=_loc_param(first.get("loc", ())))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404 and request.url.path.startswith("/v1/"):  # OpenAI's words, and what is served
            from kvfuse.service.api.openai_conventions import unknown_path

            return error_response(unknown_path(request))
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(APIError(exc.status_code, str(exc.detail), code=code))

    from kvfuse.store.errors import IndexUnavailableError, StoreReadOnlyError

    @app.exception_handler(IndexUnavailableError)
    async def _index_down(request: Request, exc: IndexUnavailableError) -> JSONResponse:
        # Redis is down: answer "try again" rather than something wrong or a bare 500.
        return error_response(APIError(503, f"the document index is unavailable: {exc}", code="index_unavailable",
                                       headers={"Retry-After": "5"}))

    @app.exception_handler(StoreReadOnlyError)
    async def _read_only(request: Request, exc: StoreReadOnlyError) -> JSONResponse:
        return error_response(APIError(503, f"the store cannot be written: {exc}", code="store_read_only"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", code="internal_error"))
