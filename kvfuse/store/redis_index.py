"""The Redis index: a copy of the LMDB document records, for deployments that set `redis_url`.

Redis layout, every key under `<namespace>:` (existing data must keep opening: bump REDIS_LAYOUT, which
triggers a rebuild from LMDB, whenever it changes)
  meta                hash: store_id (the LMDB store it mirrors), built_at, layout
  docs                zset: doc id -> created_at (listing order)
  coll:<name>         zset: the same, of one collection
  doc:<id>            hash: DocumentRecord fields, each JSON-encoded
  chunks              set: stored chunk keys
  chunk:<key>         hash: tokens, bytes, created_at
  owners:<key>        set: ids of the documents that use the chunk
Multi-key updates run in one MULTI/EXEC transaction.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from typing import TYPE_CHECKING

from kvfuse.store.errors import IndexUnavailableError, StoreError
from kvfuse.store.index import IndexMirror, IndexSnapshot
from kvfuse.store.records import ChunkInfo, DocumentRecord
from kvfuse.store.redis_access import RedisAccess

if TYPE_CHECKING:
    from redis.client import Pipeline
    from redis.typing import EncodableT

REDIS_LAYOUT = "2"  # bump when the key layout changes: a mismatch triggers a rebuild
_BATCH = 500  # commands per pipeline round trip during a rebuild



_DOC_FIELDS = [f.name for f in fields(DocumentRecord)]


class RedisIndex(IndexMirror):
    kind = "redis"

    def __init__(self, where: RedisAccess | str, namespace: str, *, timeout_s: float = 5.0) -> None:
        import redis

        self._redis = redis
        self._access = RedisAccess.coerce(where, timeout_s)
        self.url = self._access.where
        self.ns = namespace
        self._client = self._access.client(decode_responses=True)

    # --- keys
    def _k(self, *parts: str) -> str:
        return ":".join((self.ns, *parts))

    @contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        try:
            yield
        except self._redis.RedisError as err:
            denied = self._access.denied(err)  # a wrong password or certificate: a setting, not an outage
            if denied is not None:
                raise denied from None
            if isinstance(err, (self._redis.ConnectionError, self._redis.TimeoutError)):
                raise IndexUnavailableError(
                    f"the Redis index at {self.url} is unavailable ({what}): {err}; the store cannot answer "
                    "document queries until it is back"
                ) from None
            raise StoreError(f"Redis index at {self.url} failed ({what}): {err}") from err

    @staticmethod
    def _encode(doc: DocumentRecord) -> dict[EncodableT, EncodableT]:
        return {name: json.dumps(getattr(doc, name)) for name in _DOC_FIELDS}

    @staticmethod
    def _decode(h: dict[str, str]) -> DocumentRecord | None:
        return DocumentRecord.from_dict({k: json.loads(v) for k, v in h.items()}) if h else None

    def _write_doc(self, pipe: Pipeline, doc: DocumentRecord, old_collection: str | None = None) -> None:
        key = self._k("doc", doc.id)
        pipe.delete(key)  # no stale fields survive an overwrite
        pipe.hset(key, mapping=self._encode(doc))
        pipe.zadd(self._k("docs"), {doc.id: doc.created_at})
        if old_collection is not None and old_collection != doc.collection:
            pipe.zrem(self._k("coll", old_collection), doc.id)
        pipe.zadd(self._k("coll", doc.collection), {doc.id: doc.created_at})
        for ck in doc.chunk_keys:
            pipe.sadd(self._k("owners", ck), doc.id)

    def _write_chunk(self, pipe: Pipeline, info: ChunkInfo) -> None:
        pipe.hset(
            self._k("chunk", info.key),
            mapping={"tokens": info.tokens, "bytes": info.bytes, "created_at": info.created_at},
        )
        pipe.sadd(self._k("chunks"), info.key)

    def _remove_chunks(self, pipe: Pipeline, keys: Iterable[str]) -> None:
        for ck in keys:
            pipe.delete(self._k("chunk", ck), self._k("owners", ck))
            pipe.srem(self._k("chunks"), ck)

    # --- interface
    def ping(self) -> None:
        with self._guard("ping"):
            self._client.ping()

    def needs_rebuild(self, store_id: str) -> bool:
        with self._guard("read meta"):
            meta = self._client.hgetall(self._k("meta"))
        return bool(meta.get("store_id") != store_id or meta.get("layout") != REDIS_LAYOUT)

    def _delete_namespace(self) -> None:
        # Only this namespace's keys: the server may hold other data (never FLUSHDB).
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", self.ns) + ":*"
        batch: list[str] = []
        for key in self._client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= _BATCH:
                self._client.unlink(*batch)
                batch.clear()
        if batch:
            self._client.unlink(*batch)

    def invalidate(self) -> None:
        with self._guard("invalidate"):
            self._client.delete(self._k("meta"))

    def rebuild(self, store_id: str, docs: Iterable[DocumentRecord], chunks: Iterable[ChunkInfo]) -> None:
        # The meta marker goes first and comes back last: a rebuild cut short leaves no marker, so the
        # next open rebuilds again.
        with self._guard("rebuild"):
            self._client.delete(self._k("meta"))
            self._delete_namespace()
            pipe = self._client.pipeline(transaction=False)
            for n, doc in enumerate(docs, 1):
                self._write_doc(pipe, doc)
                if n % _BATCH == 0:
                    pipe.execute()
            for n, info in enumerate(chunks, 1):
                self._write_chunk(pipe, info)
                if n % _BATCH == 0:
                    pipe.execute()
            pipe.execute()
            self._client.hset(
                self._k("meta"), mapping={"store_id": store_id, "built_at": time.time(), "layout": REDIS_LAYOUT}
            )

    def put_document(
        self, doc: DocumentRecord, chunks: list[ChunkInfo], dropped: list[str], removed: list[str]
    ) -> None:
        with self._guard(f"write document {doc.id!r}"):
            old = self._client.hget(self._k("doc", doc.id), "collection")
            pipe = self._client.pipeline(transaction=True)
            self._write_doc(pipe, doc, json.loads(old) if old else None)
            for info in chunks:
                self._write_chunk(pipe, info)
            for ck in dropped:
                pipe.srem(self._k("owners", ck), doc.id)
            self._remove_chunks(pipe, removed)
            pipe.execute()

    def delete_document(self, doc_id: str, chunk_keys: list[str], removed: list[str]) -> None:
        with self._guard(f"delete document {doc_id!r}"):
            old = self._client.hget(self._k("doc", doc_id), "collection")
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(self._k("doc", doc_id))
            pipe.zrem(self._k("docs"), doc_id)
            if old:
                pipe.zrem(self._k("coll", json.loads(old)), doc_id)
            for ck in chunk_keys:
                pipe.srem(self._k("owners", ck), doc_id)
            self._remove_chunks(pipe, removed)
            pipe.execute()

    def put_chunk(self, info: ChunkInfo) -> None:
        with self._guard("write chunk"):
            pipe = self._client.pipeline(transaction=True)
            self._write_chunk(pipe, info)
            pipe.execute()

    def remove_chunks(self, keys: list[str]) -> None:
        if not keys:
            return
        with self._guard("remove chunks"):
            pipe = self._client.pipeline(transaction=True)
            self._remove_chunks(pipe, keys)
            pipe.execute()

    def get_document(self, doc_id: str) -> DocumentRecord | None:
        with self._guard(f"read document {doc_id!r}"):
            return self._decode(self._client.hgetall(self._k("doc", doc_id)))

    def list_documents(self, offset: int, limit: int,
                       collection: str | None = None) -> tuple[list[DocumentRecord], int]:
        listing = self._k("docs") if collection is None else self._k("coll", collection)
        with self._guard("list documents"):
            pipe = self._client.pipeline(transaction=True)
            pipe.zcard(listing)
            pipe.zrange(listing, offset, offset + limit - 1)
            total, ids = pipe.execute()
            if not ids or limit <= 0:
                return [], total
            pipe = self._client.pipeline(transaction=False)
            for doc_id in ids:
                pipe.hgetall(self._k("doc", doc_id))
            docs = [d for d in map(self._decode, pipe.execute()) if d is not None]
        return docs, total

    def snapshot(self) -> IndexSnapshot:
        snap = IndexSnapshot()
        with self._guard("snapshot"):
            for doc_id in self._client.zrange(self._k("docs"), 0, -1):
                doc = self.get_document(doc_id)
                if doc is not None:
                    snap.docs[doc_id] = (doc.status, doc.updated_at)
            snap.chunks = set(self._client.smembers(self._k("chunks")))
            prefix = self._k("owners", "")
            pattern = re.sub(r"([*?\[\]\\])", r"\\\1", prefix) + "*"
            for key in self._client.scan_iter(match=pattern, count=1000):
                members = frozenset(self._client.smembers(key))
                if members:
                    snap.owners[key[len(prefix) :]] = members
        return snap

    def close(self) -> None:
        self._client.close()
