"""The document index behind one read interface: embedded in LMDB, or a Redis copy (`redis_url` set).

LMDB is the source of truth: the catalog writes every record there first, in one transaction. The
embedded index *is* those records, read in place, so it has nothing to keep in step. A Redis index is a
copy, an `IndexMirror`: the catalog mirrors each write to it, and it can always be rebuilt from LMDB.
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvfuse.store.lmdb_env import LmdbEnv
from kvfuse.store.records import ChunkInfo, DocumentRecord


@dataclass
class IndexSnapshot:
    """What an index holds, in a form `kvfuse store check` compares with LMDB."""

    docs: dict[str, tuple[str, float]] = field(default_factory=dict)  # id -> (status, updated_at)
    chunks: set[str] = field(default_factory=set)
    owners: dict[str, frozenset[str]] = field(default_factory=dict)  # chunk key -> doc ids


class DocumentIndex(ABC):
    """Document reads: one record, or a page in creation order."""

    kind: str

    @abstractmethod
    def get_document(self, doc_id: str) -> DocumentRecord | None: ...

    @abstractmethod
    def list_documents(self, offset: int, limit: int,
                       collection: str | None = None) -> tuple[list[DocumentRecord], int]:
        """(one page in creation order, total count), of one collection if named."""

    def close(self) -> None:
        return None


class IndexMirror(DocumentIndex):
    """An index that is a copy of the LMDB records, kept in step write by write."""

    @abstractmethod
    def ping(self) -> None:
        """Raise IndexUnavailableError if the index cannot be used."""

    @abstractmethod
    def needs_rebuild(self, store_id: str) -> bool:
        """True when the index is empty (new, flushed) or mirrors another store."""

    @abstractmethod
    def rebuild(self, store_id: str, docs: Iterable[DocumentRecord], chunks: Iterable[ChunkInfo]) -> None:
        """Replace the whole index with these records (docs carry their chunk refs)."""

    @abstractmethod
    def invalidate(self) -> None:
        """Drop the marker, so `needs_rebuild` is True for every store until the next `rebuild`: a
        process about to change LMDB in ways it mirrors only afterwards (store/convert.py) leaves no
        index that a kill between the two would keep stale."""

    @abstractmethod
    def put_document(
        self, doc: DocumentRecord, chunks: list[ChunkInfo], dropped: list[str], removed: list[str]
    ) -> None:
        """Mirror a document write: its record, the infos of its stored chunks, the chunk keys it no
        longer uses (`dropped`) and the chunks deleted because no document uses them (`removed`)."""

    @abstractmethod
    def delete_document(self, doc_id: str, chunk_keys: list[str], removed: list[str]) -> None: ...

    @abstractmethod
    def put_chunk(self, info: ChunkInfo) -> None: ...

    @abstractmethod
    def remove_chunks(self, keys: list[str]) -> None: ...

    @abstractmethod
    def snapshot(self) -> IndexSnapshot: ...


def doctime_key(created_at: float, doc_id: str) -> bytes:
    """Key of the `doctime` database: creation time first, so a cursor lists documents in order."""
    return struct.pack(">Q", int(created_at * 1e9)) + doc_id.encode()


class EmbeddedIndex(DocumentIndex):
    """The catalog's own LMDB records, read in place."""

    kind = "embedded"

    def __init__(self, env: LmdbEnv) -> None:
        self._env = env

    def get_document(self, doc_id: str) -> DocumentRecord | None:
        with self._env.read() as txn:
            raw = txn.get(doc_id.encode(), db=self._env.db("docs"))
            return None if raw is None else DocumentRecord.from_json(raw)

    def list_documents(self, offset: int, limit: int,
                       collection: str | None = None) -> tuple[list[DocumentRecord], int]:
        """A collection's page reads every record to find its own and count them: a scan, like the
        metadata filters of the vector index."""
        docs: list[DocumentRecord] = []
        with self._env.read() as txn:
            if collection is None:
                total = txn.stat(self._env.db("docs"))["entries"]
            cur = txn.cursor(db=self._env.db("doctime"))
            i = 0
            for k in cur.iternext(keys=True, values=False):
                if collection is None and len(docs) >= limit:
                    break
                raw = txn.get(bytes(k)[8:], db=self._env.db("docs"))
                if raw is None:
                    continue
                rec = DocumentRecord.from_json(raw)
                if collection is not None and rec.collection != collection:
                    continue
                if offset <= i < offset + limit:
                    docs.append(rec)
                i += 1
        return docs, total if collection is None else i
