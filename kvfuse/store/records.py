"""Records the store keeps about documents and chunks (JSON in LMDB, hashes in Redis)."""

from __future__ import annotations

import builtins
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from kvfuse.config import DEFAULT_COLLECTION

STATUSES = ("pending", "processing", "ready", "failed")
# Error prefix of documents whose stored KV was found missing or corrupt (`kvfuse store check --repair`,
# or a CorruptBlobError at load): the service re-ingests them from their stored text.
KV_LOST = "kv_lost"
# Owner ids of an ingestion job's staged chunk refs (kvfuse.store.jobs) start with this; document ids
# never do (they start with a letter or digit), so the catalog tells them apart.
STAGING_PREFIX = "~"


@dataclass
class DocumentRecord:
    id: str
    status: str = "pending"  # pending | processing | ready | failed
    metadata: dict[str, Any] = field(default_factory=dict)
    chunk_keys: list[str] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    # per chunk, the hash of the context its KV was computed after (kvblob.context_hash); [] = all alone
    chunk_contexts: list[str] = field(default_factory=list)
    # per chunk, where that context's tokens come from, so a chunk in no tier (never computed under
    # `store.precompute_at: first_use`, or evicted) is computed after the same context as at ingestion:
    # {"span": [a, b]} (tokens a..b of this document), {"ids": [...]} (the tokens themselves), {} (alone).
    # [] = not recorded (a record from before it): kvfuse/service/rag/precompute_context.py, `recorded`
    chunk_context_src: list[dict[str, Any]] = field(default_factory=list)
    # when its chunks' KV is computed (`store.precompute_at`): "ingest" (all stored before `ready`) or
    # "first_use" (each the first time a query needs it, or ahead through POST .../precompute)
    precompute_at: str = "ingest"
    tokens: int = 0
    kv_bytes: int = 0
    created_at: float = 0.0  # 0 = set by the store on first write
    updated_at: float = 0.0  # set by the store on every write
    error: str | None = None
    content_hash: str = ""
    collection: str = DEFAULT_COLLECTION  # the retrieval scope it belongs to (records before it: the default)

    @property
    def needs_stored_kv(self) -> bool:
        """Whether every chunk must hold KV (stored, or evicted by a budget): a ready document whose KV was
        computed at ingestion; a first-use document's chunks are computed when a query needs them."""
        return self.status == "ready" and self.precompute_at != "first_use"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes | memoryview | str) -> DocumentRecord:
        return cls.from_dict(json.loads(bytes(raw) if isinstance(raw, memoryview) else raw))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DocumentRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


FIELD_NAMES = frozenset(f.name for f in fields(DocumentRecord))


@dataclass
class ChunkInfo:
    key: str
    tokens: int
    bytes: int
    created_at: float
    # when the LMDB budget evicted its blob (0: stored); its documents still use it, and it is rebuilt from
    # its token ids or read from a lower tier (docs/DESIGN.md, "Bounded tiers")
    evicted_at: float = 0.0

    def to_json(self) -> builtins.bytes:
        d = {"tokens": self.tokens, "bytes": self.bytes, "created_at": self.created_at}
        return json.dumps(d | ({"evicted_at": self.evicted_at} if self.evicted_at else {})).encode()

    @classmethod
    def from_json(cls, key: str, raw: builtins.bytes | memoryview) -> ChunkInfo:
        d = json.loads(bytes(raw))
        return cls(key=key, tokens=d["tokens"], bytes=d["bytes"], created_at=d["created_at"],
                   evicted_at=d.get("evicted_at", 0.0))


def unheld_chunks(rec: DocumentRecord, local: Callable[[str], bool],
                  objects: Callable[[str], bool] | None = None) -> list[str]:
    """The one rule of which of a document's chunks lack KV they must have (the catalog's ready check and
    `kvfuse store check`, whose "missing" it is): a chunk's KV is held if this host's LMDB holds it or
    its budget evicted it (`local`: read from below or computed after its recorded context), or the object
    store holds it (`objects`, asked only for what LMDB does not hold; None: no object store). A chunk of
    a first-use document, or of one not ready, needs none (DocumentRecord.needs_stored_kv). See
    docs/DESIGN.md, "Bounded tiers"."""
    if not rec.needs_stored_kv:
        return []
    return [k for k in rec.chunk_keys if not local(k) and (objects is None or not objects(k))]
