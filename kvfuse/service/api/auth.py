"""API keys: `Authorization: Bearer <key>` or `X-API-Key: <key>`, compared in constant time."""

from __future__ import annotations

import hmac
import ipaddress

from fastapi import Request

from kvfuse.config import ServerSettings
from kvfuse.service.errors import APIError

# Liveness and readiness probes stay open: orchestrators call them without credentials.
OPEN_PATHS = frozenset({"/health", "/ready"})


def presented_key(request: Request) -> str | None:
    auth = request.headers.get("authorization")
    if auth:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return request.headers.get("x-api-key") or None


def key_is_valid(key: str | None, accepted: list[str]) -> bool:
    if key is None:
        return False
    given = key.encode()
    # Compare against every key (no early exit) so timing says nothing about which one nearly matched.
    ok = False
    for k in accepted:
        ok |= hmac.compare_digest(given, k.encode())
    return ok


def check_request(request: Request, server: ServerSettings) -> None:
    """Raise 401 unless auth is off, the path is open, or a valid key is presented."""
    if not server.api_keys or request.url.path in OPEN_PATHS:
        return
    key = presented_key(request)
    if key is None:
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'",
                       code="missing_api_key", headers={"WWW-Authenticate": "Bearer"})
    if not key_is_valid(key, server.api_keys):
        raise APIError(401, "invalid API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname that is not "localhost" may resolve anywhere


def check_bind(host: str, server: ServerSettings) -> None:
    """Refuse to serve a non-loopback address without API keys unless explicitly allowed."""
    if is_loopback(host) or server.api_keys or server.allow_unauthenticated_public:
        return
    raise PermissionError(
        f"refusing to bind {host} with no API key: set server.api_keys (KVFUSE_SERVER__API_KEYS) or "
        "server.allow_unauthenticated_public: true"
    )
