"""One error shape everywhere: `{"error": {"message", "type", "param", "code"}}` (OpenAI-compatible).

Every failure the service reports goes through `APIError`, raised by the routes and by the ingestion and
query logic alike (it carries the status a client can act on, but nothing of HTTP's machinery); the API
answers it, and converts FastAPI's own errors, with the handlers of api/errors.py.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

# HTTP status -> OpenAI-style error type.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "request_too_large",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error answer: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorDetail


def retry_after(settings: Any) -> dict[str, str]:
    """The Retry-After header of a 503 or 409 that passes: `server.retry_after_s`, at least one second."""
    return {"Retry-After": str(max(1, settings.server.retry_after_s))}


def model_failed(reason: str) -> APIError:
    """503 `model_failed`: the model can never serve (its worker failed to load it; /health says failed with
    the same reason). No Retry-After: retrying cannot help until an operator fixes the model."""
    return APIError(503, f"the model failed: {reason}", code="model_failed")


class APIError(Exception):
    """An error answered to the client as-is."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, code=self.code, param=self.param)


def error_body(status: int, message: str, *, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    detail = ErrorDetail(message=message, type=_TYPES.get(status, "server_error"), param=param, code=code)
    return ErrorBody(error=detail).model_dump()


# Not found, worded once: a scoped API key meets the same answer for what it may not see (api/auth.py).
def collection_not_found(collection: str, *, param: str = "collection") -> APIError:
    return APIError(404, f"collection {collection!r} has no documents", code="collection_not_found", param=param)


def document_not_found(doc_id: str, *, param: str | None = None) -> APIError:
    return APIError(404, f"document {doc_id!r} not found", code="document_not_found", param=param)
