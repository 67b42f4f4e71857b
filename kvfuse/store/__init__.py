"""KV store: chunk KV in tiers (chunk_store.py: a RAM hot tier over the LMDB blob tier), documents in a
catalog (catalog.py: records, texts, chunk refs in LMDB, listed by an index embedded in LMDB or copied
to Redis), all in one LMDB environment (lmdb_env.py), the source of truth. `KVStore` (kvstore.py) wires
them together for the service.

Names are loaded on first use, so `kvfuse --help` (which imports this package's CLI) stays fast."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "CorruptBlobError": "kvfuse.kvblob",
    "DocumentNotFoundError": "kvfuse.store.errors",
    "IndexUnavailableError": "kvfuse.store.errors",
    "StoreError": "kvfuse.store.errors",
    "StoreReadOnlyError": "kvfuse.store.errors",
    "KVStore": "kvfuse.store.kvstore",
    "KV_LOST": "kvfuse.store.records",
    "STATUSES": "kvfuse.store.records",
    "ChunkInfo": "kvfuse.store.records",
    "DocumentRecord": "kvfuse.store.records",
}
__all__ = [
    "KV_LOST",
    "STATUSES",
    "ChunkInfo",
    "CorruptBlobError",
    "DocumentNotFoundError",
    "DocumentRecord",
    "IndexUnavailableError",
    "KVStore",
    "StoreError",
    "StoreReadOnlyError",
]

if TYPE_CHECKING:
    from kvfuse.kvblob import CorruptBlobError
    from kvfuse.store.errors import (
        DocumentNotFoundError,
        IndexUnavailableError,
        StoreError,
        StoreReadOnlyError,
    )
    from kvfuse.store.kvstore import KVStore
    from kvfuse.store.records import KV_LOST, STATUSES, ChunkInfo, DocumentRecord


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvfuse.store' has no attribute {name!r}")
