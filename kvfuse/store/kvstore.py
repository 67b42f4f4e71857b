"""KVStore: LMDB tier (source of truth) + index (Redis or embedded) + RAM hot tier.

Write order: every change is one LMDB transaction first (record, text, chunk refs, blobs dropped by it),
then the index mirror. Deletes go the other way: the index entry goes first (the document disappears
from view), then one LMDB transaction removes the record, its text and the blobs no other document uses,
so no document ever points at a missing blob. If a mirror write fails (Redis down), the index is marked
stale and rebuilt from LMDB when Redis answers again.

Reads: `load_chunk` parses the blob straight out of LMDB's memory map and copies the payload once
(checksummed block by block as it is copied) into tensors it owns, because an LMDB buffer dies with its
read transaction, and a read transaction held while the tensors are used would pin old pages and stop
the writer from reusing them. Those tensors go to the hot tier and to the caller, shared: callers treat them as
read-only (the fusion engine copies them into its own cache anyway). `view_chunks` gives the zero-copy
views instead, valid only inside its `with` block, for a caller that copies them itself.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import lmdb
from torch import Tensor

from kvfuse.config import Settings
from kvfuse.kvblob import CorruptBlobError, KVHeader, decode, verify_blob
from kvfuse.store.errors import DocumentNotFoundError, IndexUnavailableError, StoreError
from kvfuse.store.hot_tier import Entry, HotTier
from kvfuse.store.index import EmbeddedIndex, Index, RedisIndex, doctime_key
from kvfuse.store.lmdb_tier import LmdbTier
from kvfuse.store.records import FIELD_NAMES, STATUSES, ChunkInfo, DocumentRecord

log = logging.getLogger(__name__)

_MAX_ID_BYTES = 400  # LMDB keys are at most 511 bytes (and doctime keys add 8)
_UPDATABLE = FIELD_NAMES - {"id", "status", "error", "created_at", "updated_at"}


def _check_id(doc_id: str) -> bytes:
    raw = doc_id.encode()
    if not raw or len(raw) > _MAX_ID_BYTES:
        raise ValueError(f"document id must be 1..{_MAX_ID_BYTES} bytes of UTF-8, got {len(raw)}")
    return raw


class KVStore:
    def __init__(self, settings: Settings, tier: LmdbTier, index: Index, *, readonly: bool) -> None:
        self.settings = settings
        self.tier = tier
        self.index = index
        self.readonly = readonly
        self.hot = HotTier(settings.store.hot_tier_mb << 20)
        self._verify = settings.store.verify_checksums
        self._index_lost = False  # a call failed: re-check the index when it answers again
        self._index_stale = False  # a mirror write failed: rebuild when it answers again
        self._mirror_lock = threading.RLock()
        self.store_id = self._ensure_store_id()

    @classmethod
    def open(cls, settings: Settings, *, readonly: bool = False) -> KVStore:
        s = settings.store
        tier = LmdbTier(
            settings.lmdb_dir, map_size=s.lmdb_map_size_mb << 20, max_readers=s.lmdb_max_readers, readonly=readonly
        )
        try:
            index: Index = (
                RedisIndex(settings.redis_url, s.redis_namespace, timeout_s=s.redis_timeout_s)
                if settings.redis_url
                else EmbeddedIndex(tier)
            )
            store = cls(settings, tier, index, readonly=readonly)
            store._sync_index()
        except BaseException:
            tier.close()
            raise
        return store

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.hot.clear()
        self.index.close()
        self.tier.close()

    # --- index upkeep
    def _ensure_store_id(self) -> str:
        with self.tier.read() as txn:
            raw = txn.get(b"store_id", db=self.tier.db("meta"))
            if raw is not None:
                return bytes(raw).decode()
        if self.readonly:
            return ""
        new = uuid.uuid4().hex

        def fn(txn: lmdb.Transaction) -> str:
            raw = txn.get(b"store_id", db=self.tier.db("meta"))
            if raw is not None:  # another process got there first
                return bytes(raw).decode()
            txn.put(b"store_id", new.encode(), db=self.tier.db("meta"))
            return new

        return self.tier.write(fn)

    def _sync_index(self) -> None:
        self.index.ping()
        if self._index_stale or self.index.needs_rebuild(self.store_id):
            if self.readonly:
                log.warning("the %s index does not mirror this store; run `kvfuse store rebuild-index`", self.index.kind)
            elif self._index_stale or self.settings.store.rebuild_index_on_empty:
                log.info("rebuilding the %s index from LMDB", self.index.kind)
                self.rebuild_index()
            else:
                log.warning("the %s index is empty; rebuild_index_on_empty is off", self.index.kind)
        self._index_stale = False

    @contextmanager
    def _indexed(self, *, write: bool = False) -> Iterator[Index]:
        """The index, re-checked first if it failed before. Mirror writes (`write`) hold the mirror lock,
        so a rebuild never runs between another thread's LMDB write and its mirror write."""
        with self._mirror_lock if write else nullcontext():
            try:
                if self._index_lost:
                    self._sync_index()
                    self._index_lost = False
                yield self.index
            except IndexUnavailableError:
                self._index_lost = True
                self._index_stale = self._index_stale or write  # the LMDB write is done; its mirror is not
                raise

    def rebuild_index(self) -> dict:
        """Replace the index with the LMDB records; returns counts."""
        with self._mirror_lock:
            docs, chunks = self._all_records()
            self.index.rebuild(self.store_id, docs, chunks)
        return {"index": self.index.kind, "documents": len(docs), "chunks": len(chunks)}

    def _all_records(self) -> tuple[list[DocumentRecord], list[ChunkInfo]]:
        with self.tier.read() as txn:
            docs = [DocumentRecord.from_json(v) for _, v in txn.cursor(db=self.tier.db("docs"))]
            blobs = self.tier.db("chunks")
            chunks = [  # an info whose blob is gone (damage behind the store's back) is not a chunk
                ChunkInfo.from_json(bytes(k).decode(), v)
                for k, v in txn.cursor(db=self.tier.db("chunkinfo"))
                if txn.get(bytes(k), db=blobs) is not None
            ]
        return docs, chunks

    # --- LMDB helpers (inside a transaction)
    def _add_kv_bytes(self, txn: lmdb.Transaction, delta: int) -> None:
        meta = self.tier.db("meta")
        raw = txn.get(b"kv_bytes", db=meta)
        total = (int(bytes(raw)) if raw is not None else 0) + delta
        txn.put(b"kv_bytes", str(max(total, 0)).encode(), db=meta)

    def _drop_chunk(self, txn: lmdb.Transaction, key: bytes) -> bool:
        blob = txn.get(key, db=self.tier.db("chunks"))
        if blob is None:
            return False
        self._add_kv_bytes(txn, -len(blob))
        txn.delete(key, db=self.tier.db("chunks"))
        txn.delete(key, db=self.tier.db("chunkinfo"))
        return True

    def _chunk_infos(self, txn: lmdb.Transaction, keys: Iterable[str]) -> list[ChunkInfo]:
        infos = []
        for k in dict.fromkeys(keys):
            raw = txn.get(k.encode(), db=self.tier.db("chunkinfo"))
            if raw is not None:
                infos.append(ChunkInfo.from_json(k, raw))
        return infos

    def _write_doc(
        self, txn: lmdb.Transaction, old: DocumentRecord | None, rec: DocumentRecord, text: str | None
    ) -> tuple[DocumentRecord, list[ChunkInfo], list[str], list[str]]:
        """Write `rec` (replacing `old`) with its text and chunk refs; drop blobs no document uses now.
        Returns (record, infos of its stored chunks, keys it dropped, keys deleted)."""
        db = self.tier.db
        doc_key = _check_id(rec.id)
        if rec.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {rec.status!r}")
        if rec.chunk_tokens and len(rec.chunk_tokens) != len(rec.chunk_keys):
            raise ValueError(f"{len(rec.chunk_keys)} chunk keys but {len(rec.chunk_tokens)} chunk token counts")
        if rec.status == "ready":
            missing = [k for k in rec.chunk_keys if txn.get(k.encode(), db=db("chunks")) is None]
            if missing:
                raise StoreError(f"document {rec.id!r} cannot be ready: {len(missing)} chunk blobs are missing")
        txn.put(doc_key, rec.to_json(), db=db("docs"))
        if old is not None:
            txn.delete(doctime_key(old.created_at, old.id), db=db("doctime"))
        txn.put(doctime_key(rec.created_at, rec.id), b"", db=db("doctime"))
        if text is not None:
            txn.put(doc_key, text.encode(), db=db("texts"))
        old_keys = set(old.chunk_keys) if old else set()
        new_keys = set(rec.chunk_keys)
        for k in new_keys - old_keys:
            txn.put(k.encode(), doc_key, db=db("refs"), dupdata=True)
        dropped = sorted(old_keys - new_keys)
        removed = []
        for k in dropped:
            kb = k.encode()
            txn.delete(kb, doc_key, db=db("refs"))
            if txn.get(kb, db=db("refs")) is None and self._drop_chunk(txn, kb):
                removed.append(k)
        return rec, self._chunk_infos(txn, rec.chunk_keys), dropped, removed

    def _mirror_doc(self, out: tuple[DocumentRecord, list[ChunkInfo], list[str], list[str]]) -> None:
        rec, infos, dropped, removed = out
        for k in removed:
            self.hot.discard(k)
        with self._indexed(write=True) as ix:
            ix.put_document(rec, infos, dropped, removed)

    # --- chunks
    def put_chunk(self, key: str, blob: bytes) -> bool:
        """Store a blob under its content key; False if a valid copy is already there."""
        header = verify_blob(blob)
        if header.key != key:
            raise ValueError(f"blob belongs under key {header.key}, not {key}")
        info = ChunkInfo(key=key, tokens=header.num_tokens, bytes=len(blob), created_at=time.time())
        kb = key.encode()

        def fn(txn: lmdb.Transaction) -> bool:
            existing = txn.get(kb, db=self.tier.db("chunks"))
            if existing is not None:
                try:
                    verify_blob(existing)
                    return False
                except CorruptBlobError as err:
                    log.warning("replacing corrupt blob %s: %s", key, err)
                self._add_kv_bytes(txn, -len(existing))
            txn.put(kb, blob, db=self.tier.db("chunks"))
            txn.put(kb, info.to_json(), db=self.tier.db("chunkinfo"))
            self._add_kv_bytes(txn, len(blob))
            return True

        added = self.tier.write(fn)
        if added:
            self.hot.discard(key)
            with self._indexed(write=True) as ix:
                ix.put_chunk(info)
        return added

    def has_chunk(self, key: str) -> bool:
        """Whether LMDB holds the blob. Not the hot tier: another process may have deleted the blob while
        this one still holds it decoded (content-addressed, so still right to serve, but not stored)."""
        with self.tier.read() as txn:
            return txn.get(key.encode(), db=self.tier.db("chunks")) is not None

    @staticmethod
    def _check_key(key: str, header: KVHeader) -> None:
        if header.key != key:  # a blob under a key that is not its own would be served for the wrong chunk
            raise CorruptBlobError(f"blob stored under {key} belongs under {header.key}")

    def load_chunk(self, key: str) -> tuple[Tensor, Tensor, KVHeader] | None:
        """(k, v, header) from the hot tier, else LMDB (then kept hot); None = miss. The tensors are
        shared: do not modify them in place. Raises CorruptBlobError (rebuild it from the text)."""
        entry = self.hot.get(key)
        if entry is not None:
            return entry
        with self.tier.read() as txn:
            buf = txn.get(key.encode(), db=self.tier.db("chunks"))
            if buf is None:
                return None
            entry = decode(buf, verify=self._verify, copy=True)  # the one copy, before the txn ends
        self._check_key(key, entry[2])
        self.hot.put(key, entry)
        return entry

    @contextmanager
    def view_chunks(self, keys: list[str]) -> Iterator[dict[str, Entry | None]]:
        """{key: (k, v, header) or None}: zero-copy views of LMDB's memory map (or hot-tier entries),
        valid only inside the `with` block; copy what you keep, and call no other store method inside
        it (the open read transaction would block a map resize). Nothing is added to the hot tier.
        Raises CorruptBlobError."""
        with self.tier.read() as txn:
            out: dict[str, Entry | None] = {}
            for key in keys:
                entry = self.hot.get(key)
                if entry is None:
                    buf = txn.get(key.encode(), db=self.tier.db("chunks"))
                    if buf is not None:
                        entry = decode(buf, verify=self._verify)
                        self._check_key(key, entry[2])
                out[key] = entry
            yield out

    # --- documents
    def put_document(self, doc: DocumentRecord, text: str | None = None) -> None:
        """Create or replace a document: record, text and chunk refs in one transaction. `text` is
        required for a new document (KV is rebuilt from it) and kept when None. A `ready` document must
        refer only to stored chunks. created_at is kept from the first write; updated_at is now."""
        _check_id(doc.id)
        now = time.time()

        def fn(txn: lmdb.Transaction):
            raw = txn.get(doc.id.encode(), db=self.tier.db("docs"))
            old = DocumentRecord.from_json(raw) if raw is not None else None
            if old is None and text is None:
                raise ValueError(f"new document {doc.id!r} needs its text")
            created = old.created_at if old else (doc.created_at or now)
            return self._write_doc(txn, old, replace(doc, created_at=created, updated_at=now), text)

        self._mirror_doc(self.tier.write(fn))

    def set_status(self, doc_id: str, status: str, *, error: str | None = None, **fields: object) -> None:
        """Update a document's status (error is cleared unless given) and any other record fields,
        e.g. chunk_keys=..., chunk_tokens=..., tokens=..., kv_bytes=... Raises DocumentNotFoundError."""
        unknown = set(fields) - _UPDATABLE
        if unknown:
            raise ValueError(f"cannot set {sorted(unknown)}; updatable fields are {sorted(_UPDATABLE)}")
        now = time.time()

        def fn(txn: lmdb.Transaction):
            raw = txn.get(_check_id(doc_id), db=self.tier.db("docs"))
            if raw is None:
                raise DocumentNotFoundError(f"no document {doc_id!r}")
            old = DocumentRecord.from_json(raw)
            return self._write_doc(txn, old, replace(old, status=status, error=error, updated_at=now, **fields), None)

        self._mirror_doc(self.tier.write(fn))

    def get_document(self, doc_id: str) -> DocumentRecord | None:
        with self._indexed() as ix:
            return ix.get_document(doc_id)

    def get_text(self, doc_id: str) -> str | None:
        with self.tier.read() as txn:
            raw = txn.get(doc_id.encode(), db=self.tier.db("texts"))
            return None if raw is None else bytes(raw).decode()

    def list_documents(self, *, offset: int = 0, limit: int = 50) -> tuple[list[DocumentRecord], int]:
        """(one page in creation order, total count)."""
        with self._indexed() as ix:
            return ix.list_documents(max(offset, 0), max(limit, 0))

    def delete_document(self, doc_id: str) -> bool:
        """Remove the document, its text, its index entries, and the blobs no other document uses."""
        doc_key = _check_id(doc_id)
        db = self.tier.db
        with self.tier.read() as txn:
            raw = txn.get(doc_key, db=db("docs"))
            old = DocumentRecord.from_json(raw) if raw is not None else None
            orphaned = [k for k in dict.fromkeys(old.chunk_keys) if self._only_owner(txn, k, doc_key)] if old else []
        with self._indexed(write=True) as ix:
            stale = ix.get_document(doc_id) if old is None else None
            if old is None and stale is None:
                return False
            gone = old or stale
            assert gone is not None
            ix.delete_document(doc_id, gone.chunk_keys, orphaned)
        if old is None:
            return False  # only the index still had it

        def fn(txn: lmdb.Transaction) -> list[str]:
            raw = txn.get(doc_key, db=db("docs"))
            if raw is None:
                return []
            cur = DocumentRecord.from_json(raw)
            txn.delete(doc_key, db=db("docs"))
            txn.delete(doctime_key(cur.created_at, cur.id), db=db("doctime"))
            txn.delete(doc_key, db=db("texts"))
            removed = []
            for k in dict.fromkeys(cur.chunk_keys):
                kb = k.encode()
                txn.delete(kb, doc_key, db=db("refs"))
                if txn.get(kb, db=db("refs")) is None and self._drop_chunk(txn, kb):
                    removed.append(k)
            return removed

        removed = self.tier.write(fn)
        for k in removed:
            self.hot.discard(k)
        extra = sorted(set(removed) - set(orphaned))  # a concurrent writer changed the refs meanwhile
        if extra:
            with self._indexed(write=True) as ix:
                ix.remove_chunks(extra)
        return True

    def _only_owner(self, txn: lmdb.Transaction, key: str, doc_key: bytes) -> bool:
        cur = txn.cursor(db=self.tier.db("refs"))
        if not cur.set_key(key.encode()):
            return True
        return all(bytes(v) == doc_key for v in cur.iternext_dup(keys=False, values=True))

    # --- housekeeping
    def stats(self) -> dict:
        db = self.tier.db
        with self.tier.read() as txn:
            raw = txn.get(b"kv_bytes", db=db("meta"))
            out = {
                "documents": txn.stat(db("docs"))["entries"],
                "chunks": txn.stat(db("chunks"))["entries"],
                "kv_bytes": int(bytes(raw)) if raw is not None else 0,
            }
        info, st = self.tier.env.info(), self.tier.env.stat()
        out |= {
            "index": self.index.kind,
            "lmdb_map_bytes": info["map_size"],
            "lmdb_used_bytes": (info["last_pgno"] + 1) * st["psize"],
        }
        return out | self.hot.stats()
