"""API keys and what each may do.

A request presents a key (`Authorization: Bearer <key>` or `X-API-Key: <key>`), compared in constant time
against the `KeyRing`: `server.api_keys` (a list of full-access keys, or a mapping of scoped ones),
`server.api_keys_file` (JSON or YAML: key -> {collections, access}) and `api_key` / `api_key_file` (the
`KVFUSE_API_KEY` clients send, one full-access key). The middleware puts the key's `Principal` on the
request; routes get it with the `Caller` dependency (dependencies.py) and apply it where they pick
collections and documents, so a scoped key is confined however a route is reached.

A key sees what its `allowed_collections` hold: what it may not see answers exactly as what does not
exist (404 with the same message), so names cannot be probed; a write with a read-only key is 403. What is
counted over every collection and kept for none (/metrics unless `server.metrics_public`, /v1/fidelity)
needs a key that sees every collection (403 otherwise). docs/deploy.md, "Exposing kvfuse".
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import Request

from kvfuse.config import ServerSettings
from kvfuse.config.serving import KeyScope
from kvfuse.service.errors import APIError, collection_not_found, document_not_found
from kvfuse.store.redis_access import read_secret

if TYPE_CHECKING:
    from kvfuse.config import Settings

# Liveness and readiness probes stay open: orchestrators call them without credentials.
OPEN_PATHS = frozenset({"/health", "/ready"})
OPEN_ACCESS_KEY = "open"  # the one caller when no API key is set
METRICS_PATH = "/metrics"


@dataclass(frozen=True)
class Principal:
    """What the caller's key may do. `allowed_collections` None: every collection."""

    allowed_collections: frozenset[str] | None = None
    can_write: bool = True

    @classmethod
    def of(cls, scope: KeyScope) -> Principal:
        cols = None if scope.collections is None else frozenset(scope.collections)
        return cls(allowed_collections=cols, can_write=scope.access == "write")

    @property
    def scoped(self) -> bool:
        return self.allowed_collections is not None

    def sees(self, collection: str) -> bool:
        return self.allowed_collections is None or collection in self.allowed_collections

    def visible(self, collections: Iterable[str]) -> list[str]:
        """Those of `collections` this key sees, in their order."""
        return [c for c in collections if self.sees(c)]

    def check_collection(self, collection: str) -> None:
        """404, as for a collection with no documents, unless this key sees `collection`."""
        if not self.sees(collection):
            raise collection_not_found(collection)

    def check_document(self, doc_id: str, collection: str, *, param: str | None = None) -> None:
        """404, as for a document that does not exist, unless this key sees the document's collection."""
        if not self.sees(collection):
            raise document_not_found(doc_id, param=param)

    def check_write(self, collection: str | None = None) -> None:
        """403 for a read-only key, or (given `collection`) for a collection this key does not see: the
        answer is the same whether the collection exists or not, so it tells nothing."""
        if not self.can_write:
            raise APIError(403, "this API key is read-only: it may list, read, query and search, not change "
                                "documents", code="read_only_key")
        if collection is not None and not self.sees(collection):
            raise APIError(403, f"this API key may not write to collection {collection!r}",
                           code="collection_forbidden", param="collection")

    def check_admin(self, what: str) -> None:
        """403 unless this key writes and sees every collection: `what` concerns every collection's
        users (the query log), which a key confined to some collections may not touch."""
        self.check_write()
        self.check_every_collection(what)

    def check_every_collection(self, what: str) -> None:
        """403 unless this key sees every collection: `what` is counted over all of them and kept for none
        (the metrics, the fidelity ledger), so a key confined to some would learn of the others. 403, not
        404: the route exists for every key, and the answer names no collection."""
        if self.scoped:
            raise APIError(403, f"{what} needs a key that sees every collection; this one is limited to "
                                "some", code="collection_forbidden")


FULL_ACCESS = Principal()


class KeyRing:
    """Every accepted key with its principal; empty = authentication off."""

    def __init__(self, keys: dict[str, Principal]) -> None:
        self._keys = [(k.encode(), p) for k, p in keys.items()]

    @classmethod
    def of(cls, settings: Settings) -> KeyRing:
        """From the settings; raises ValueError naming the setting when a key file cannot be read."""
        server = settings.server
        keys: dict[str, Principal] = {}
        if isinstance(server.api_keys, dict):
            keys.update({k: Principal.of(s) for k, s in server.api_keys.items()})
        else:
            keys.update(dict.fromkeys(server.api_keys, FULL_ACCESS))
        if server.api_keys_file:
            keys.update({k: Principal.of(s) for k, s in read_key_file(server.api_keys_file).items()})
        if settings.api_key:
            keys[settings.api_key] = FULL_ACCESS
        if settings.api_key_file:
            keys[read_secret(settings.api_key_file, "api_key_file")] = FULL_ACCESS
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def principal(self, key: str | None) -> Principal | None:
        """The key's principal, None for an unknown key. Every key is compared (no early exit), so timing
        says nothing about which one nearly matched."""
        if key is None:
            return None
        given = key.encode()
        found: Principal | None = None
        for k, p in self._keys:
            if hmac.compare_digest(given, k):
                found = p
        return found


def read_key_file(path: str) -> dict[str, KeyScope]:
    """server.api_keys_file: a JSON or YAML mapping key -> {collections, access} (`{}` = full access)."""
    import yaml
    from pydantic import TypeAdapter, ValidationError

    what = f"server.api_keys_file {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"{what}: cannot read it: {err.strerror or err}") from None
    try:
        raw: Any = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ValueError(f"{what}: not valid JSON or YAML: {err}") from None
    if not isinstance(raw, dict) or not all(isinstance(k, str) and k.strip() for k in raw):
        raise ValueError(f"{what}: must map each key (a non-empty string) to {{collections, access}}")
    try:
        return TypeAdapter(dict[str, KeyScope]).validate_python({k: v or {} for k, v in raw.items()})
    except ValidationError as err:
        first = err.errors()[0]
        raise ValueError(f"{what}: {'.'.join(map(str, first['loc'][1:]))}: {first['msg']}") from None


def presented_key(request: Request) -> str | None:
    auth = request.headers.get("authorization")
    if auth:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return request.headers.get("x-api-key") or None


def check_request(request: Request, keys: KeyRing, server: ServerSettings) -> None:
    """Raise 401 unless auth is off, the path is open, or a valid key is presented; put the key's
    principal on the request (`request.state.principal`, read by the `Caller` dependency)."""
    if not keys.enabled:
        request.state.principal = FULL_ACCESS
        request.state.client_key = OPEN_ACCESS_KEY
        return
    path = request.url.path
    if path in OPEN_PATHS or (server.metrics_public and path == METRICS_PATH):
        return
    key = presented_key(request)
    if key is None:
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'",
                       code="missing_api_key", headers={"WWW-Authenticate": "Bearer"})
    principal = keys.principal(key)
    if principal is None:
        raise APIError(401, "invalid API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    request.state.principal = principal
    request.state.client_key = hashlib.sha256(key.encode()).hexdigest()[:16]


def client_key(request: Request) -> str:
    """Which API key sent the request, as a digest (not the key): what the ingestion queue shares
    between (rag/ingest_queue.py). One name for every caller when auth is off."""
    return getattr(request.state, "client_key", OPEN_ACCESS_KEY)


def request_principal(request: Request) -> Principal:
    """The principal the middleware found; a route outside the middleware's reach (none today) is refused
    rather than given full access."""
    principal = getattr(request.state, "principal", None)
    if principal is None:
        raise APIError(401, "missing API key", code="missing_api_key", headers={"WWW-Authenticate": "Bearer"})
    return principal


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname that is not "localhost" may resolve anywhere


def check_bind(host: str, keys: KeyRing, server: ServerSettings) -> None:
    """Refuse to serve a non-loopback address without API keys unless explicitly allowed."""
    if is_loopback(host) or keys.enabled or server.allow_unauthenticated_public:
        return
    raise PermissionError(
        f"refusing to bind {host} with no API key: set KVFUSE_API_KEY, server.api_keys (KVFUSE_SERVER__API_KEYS) "
        "or server.api_keys_file, or server.allow_unauthenticated_public: true"
    )
