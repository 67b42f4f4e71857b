"""The document catalog: records, texts and chunk references in LMDB, and the index that lists them.

Write order: every change is one LMDB transaction first (record, text, chunk refs, and the blobs no
document uses any more, dropped from the blob tier in that same transaction), then the index mirror, if
the index is a copy (Redis). Deletes go the other way: the mirror entry goes first (the document
disappears from view), then one LMDB transaction removes the record, its text and the blobs no other
document uses, so no document ever points at a missing blob. If a mirror write fails (Redis down), the
mirror is marked stale and rebuilt from LMDB when Redis answers again (mirror_sync.py). Blobs a transaction dropped are
then forgotten by the tiers above LMDB (`forget`).

Document reads go to the index: the LMDB records themselves when embedded, else the Redis copy (and
fail with IndexUnavailableError while Redis is down, rather than answer from a stale view). A Redis that
came back empty without any call failing meanwhile is found by its missing marker (on a miss, a listing
or a readiness probe) and rebuilt the same way.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from typing import Any, NamedTuple

import lmdb

from kvfuse.store.errors import DocumentNotFoundError, IndexUnavailableError, StoreError, StoreReadOnlyError
from kvfuse.store.index import DocumentIndex, IndexMirror, IndexSnapshot, doctime_key
from kvfuse.store.lmdb_env import LmdbEnv
from kvfuse.store.lmdb_tier import LmdbTier
from kvfuse.store.mirror_sync import MirrorSync
from kvfuse.store.object_holds import ObjectHolds, write_after_asking
from kvfuse.store.records import (
    FIELD_NAMES,
    STAGING_PREFIX,
    STATUSES,
    ChunkInfo,
    DocumentRecord,
    unheld_chunks,
)

log = logging.getLogger(__name__)

_MAX_ID_BYTES = 400  # LMDB keys are at most 511 bytes (and doctime keys add 8)
_UPDATABLE = FIELD_NAMES - {"id", "status", "error", "created_at", "updated_at"}


def _check_id(doc_id: str) -> bytes:
    raw = doc_id.encode()
    if not raw or len(raw) > _MAX_ID_BYTES:
        raise ValueError(f"document id must be 1..{_MAX_ID_BYTES} bytes of UTF-8, got {len(raw)}")
    return raw


class _Written(NamedTuple):
    record: DocumentRecord
    infos: list[ChunkInfo]  # of its stored chunks (for the mirror; empty without one)
    dropped: list[str]  # chunk keys it no longer uses
    removed: list[str]  # blobs deleted because no document uses them now


class DocumentCatalog:
    def __init__(
        self,
        env: LmdbEnv,
        blobs: LmdbTier,
        index: DocumentIndex,
        *,
        forget: Callable[[Iterable[str]], None],
        rebuild_on_empty: bool = True,
        require_index: bool = True,
        unreferenced: Callable[[lmdb.Transaction, str], None] | None = None,
    ) -> None:  # unreferenced(txn, key): a chunk's last ref went in txn (object_tier.py lists its object)
        self.env = env
        self.blobs = blobs
        self.index = index
        self.mirror = index if isinstance(index, IndexMirror) else None
        self._forget = forget
        self._unreferenced = unreferenced
        # Whether the object store holds a chunk (set by KVStore when one is configured): a chunk only
        # there is held too (records.unheld_chunks).
        self.in_objects: Callable[[str], bool] | None = None
        self._docs, self._doctime = env.db("docs"), env.db("doctime")
        self._texts, self._refs, self._meta = env.db("texts"), env.db("refs"), env.db("meta")
        self.store_id = self._ensure_store_id()
        self.sync: MirrorSync | None = None
        if self.mirror is not None:
            self.sync = MirrorSync(self.mirror, self.rebuild_index, readonly=env.readonly,
                                   rebuild_on_empty=rebuild_on_empty)
            self.sync.store_id = self.store_id
            try:
                self.sync.sync()
            except IndexUnavailableError:
                if require_index:
                    raise
                log.warning("the %s index is not available yet: it is checked again at its first use", index.kind)
                self.sync.lost = True

    def close(self) -> None:
        self.index.close()

    # --- writes
    def put_document(self, doc: DocumentRecord, text: str | None = None, *,
                     also: Callable[[lmdb.Transaction], list[str]] | None = None) -> None:
        """Create or replace a document: record, text and chunk refs in one transaction. `text` is
        required for a new document (KV is rebuilt from it) and kept when None. A `ready` document must
        refer only to stored chunks. created_at is kept from the first write; updated_at is now.
        `also` runs in the same transaction after the write (a job's swap, store/jobs.py) and returns
        the blobs it removed."""
        _check_id(doc.id)
        now = time.time()

        def fn(txn: lmdb.Transaction, holds: ObjectHolds | None) -> _Written:
            old = self._record(txn, doc.id)
            if old is None and text is None:
                raise ValueError(f"new document {doc.id!r} needs its text")
            created = old.created_at if old else (doc.created_at or now)
            written = self._write(txn, old, replace(doc, created_at=created, updated_at=now), text, holds)
            if also is not None:
                written = written._replace(removed=written.removed + also(txn))
            return written

        self._mirror_write(self._write_checked(fn, lambda txn: doc))

    def set_status(self, doc_id: str, status: str, *, error: str | None = None, **fields: Any) -> None:
        """Update a document's status (error is cleared unless given) and any other record fields,
        e.g. chunk_keys=..., chunk_tokens=..., tokens=..., kv_bytes=... Raises DocumentNotFoundError."""
        unknown = set(fields) - _UPDATABLE
        if unknown:
            raise ValueError(f"cannot set {sorted(unknown)}; updatable fields are {sorted(_UPDATABLE)}")
        now = time.time()

        def fn(txn: lmdb.Transaction, holds: ObjectHolds | None) -> _Written:
            old = self._record(txn, doc_id)
            if old is None:
                raise DocumentNotFoundError(f"no document {doc_id!r}")
            return self._write(txn, old, replace(old, status=status, error=error, updated_at=now, **fields), None,
                               holds)

        def planned(txn: lmdb.Transaction) -> DocumentRecord | None:
            old = self._record(txn, doc_id)
            return None if old is None else replace(old, status=status, **fields)

        self._mirror_write(self._write_checked(fn, planned))

    def delete_document(self, doc_id: str) -> bool:
        """Remove the document, its text, its index entries, and the blobs no other document uses."""
        doc_key = _check_id(doc_id)
        with self.env.read() as txn:
            old = self._record(txn, doc_id)
            orphaned = [k for k in dict.fromkeys(old.chunk_keys) if self._only_owner(txn, k, doc_key)] if old else []
        if self.mirror is not None:
            with self._mirrored() as m:
                gone = old or m.get_document(doc_id)  # the mirror may still have what LMDB lost
                if gone is not None:
                    m.delete_document(doc_id, gone.chunk_keys, orphaned)
        if old is None:
            return False

        def fn(txn: lmdb.Transaction) -> list[str]:
            cur = self._record(txn, doc_id)
            if cur is None:
                return []
            txn.delete(doc_key, db=self._docs)
            txn.delete(doctime_key(cur.created_at, cur.id), db=self._doctime)
            txn.delete(doc_key, db=self._texts)
            return self._release(txn, doc_key, dict.fromkeys(cur.chunk_keys))

        removed = self.env.write(fn)
        self._forget(removed)
        extra = sorted(set(removed) - set(orphaned))  # a concurrent writer changed the refs meanwhile
        if extra and self.mirror is not None:
            with self._mirrored() as m:
                m.remove_chunks(extra)
        return True

    # --- refs under other owners than documents (a job's staged version, store/jobs.py)
    def add_refs(self, txn: lmdb.Transaction, owner: str, keys: Iterable[str]) -> None:
        ob = owner.encode()
        for k in keys:
            txn.put(k.encode(), ob, db=self._refs, dupdata=True)

    def release_refs(self, txn: lmdb.Transaction, owner: str, keys: Iterable[str]) -> list[str]:
        """Drop `owner`'s refs to `keys`; returns the blobs that went because nothing uses them now."""
        return self._release(txn, owner.encode(), keys)

    def write_releasing(self, fn: Callable[[lmdb.Transaction], list[str]]) -> None:
        """Run `fn` in one write transaction; the blobs it returns (removed) leave the tiers above and
        the mirror too."""
        removed = self.env.write(fn)
        self._forget(removed)
        if removed and self.mirror is not None:
            with self._mirrored() as m:
                m.remove_chunks(removed)

    def chunk_stored(self, key: str) -> None:
        """Mirror a chunk the blob tier just stored (the embedded index lists the blobs themselves)."""
        if self.mirror is None:
            return
        with self.env.read() as txn:
            info = self.blobs.info(txn, key)
        if info is not None:
            with self._mirrored() as m:
                m.put_chunk(info)

    def _in_lmdb(self, txn: lmdb.Transaction) -> Callable[[str], bool]:
        """Whether this host's LMDB holds a chunk's KV (stored, or evicted by its budget)."""
        return lambda k: self.blobs.stored(txn, k) or self.blobs.evicted(txn, k)

    def _write_checked(self, fn: Callable[[lmdb.Transaction, ObjectHolds | None], _Written],
                       planned: Callable[[lmdb.Transaction], DocumentRecord | None]) -> _Written:
        """Run `fn` in one write transaction, the object store asked first, in no LMDB transaction, about
        the chunks LMDB does not hold of the record `planned` reads (object_holds.py)."""
        if self.in_objects is None:
            return self.env.write(lambda txn: fn(txn, None))

        def unknown(txn: lmdb.Transaction) -> list[str]:
            rec = planned(txn)
            return [] if rec is None else unheld_chunks(rec, self._in_lmdb(txn))

        return write_after_asking(self.env, ObjectHolds(self.in_objects), fn, unknown)

    def _write(
        self, txn: lmdb.Transaction, old: DocumentRecord | None, rec: DocumentRecord, text: str | None,
        holds: ObjectHolds | None,
    ) -> _Written:
        """Write `rec` (replacing `old`) with its text and chunk refs; drop blobs no document uses now.
        `holds`: the object store's answers, asked before this transaction (None: no object store)."""
        doc_key = _check_id(rec.id)
        if rec.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {rec.status!r}")
        if rec.chunk_tokens and len(rec.chunk_tokens) != len(rec.chunk_keys):
            raise ValueError(f"{len(rec.chunk_keys)} chunk keys but {len(rec.chunk_tokens)} chunk token counts")
        in_lmdb = self._in_lmdb(txn)
        if holds is not None:
            holds.require(unheld_chunks(rec, in_lmdb))
        missing = unheld_chunks(rec, in_lmdb, holds)
        if missing:
            raise StoreError(f"document {rec.id!r} cannot be ready: {len(missing)} chunk blobs are missing")
        txn.put(doc_key, rec.to_json(), db=self._docs)
        if old is not None:
            txn.delete(doctime_key(old.created_at, old.id), db=self._doctime)
        txn.put(doctime_key(rec.created_at, rec.id), b"", db=self._doctime)
        if text is not None:
            txn.put(doc_key, text.encode(), db=self._texts)
        old_keys = set(old.chunk_keys) if old else set()
        new_keys = set(rec.chunk_keys)
        for k in new_keys - old_keys:
            txn.put(k.encode(), doc_key, db=self._refs, dupdata=True)
        dropped = sorted(old_keys - new_keys)
        removed = self._release(txn, doc_key, dropped)
        infos = self.blobs.infos(txn, rec.chunk_keys) if self.mirror is not None else []
        return _Written(rec, infos, dropped, removed)

    def _release(self, txn: lmdb.Transaction, doc_key: bytes, keys: Iterable[str]) -> list[str]:
        """Drop the document's refs to `keys`; the blobs left with no ref go too. Returns those keys."""
        removed = []
        for k in keys:
            kb = k.encode()
            txn.delete(kb, doc_key, db=self._refs)
            if txn.get(kb, db=self._refs) is not None:
                continue
            if self._unreferenced is not None:
                self._unreferenced(txn, k)
            if self.blobs.drop(txn, k):
                removed.append(k)
        return removed

    def _only_owner(self, txn: lmdb.Transaction, key: str, doc_key: bytes) -> bool:
        cur = txn.cursor(db=self._refs)
        if not cur.set_key(key.encode()):
            return True
        return all(bytes(v) == doc_key for v in cur.iternext_dup(keys=False, values=True))

    def _record(self, txn: lmdb.Transaction, doc_id: str) -> DocumentRecord | None:
        raw = txn.get(_check_id(doc_id), db=self._docs)
        return None if raw is None else DocumentRecord.from_json(raw)

    # --- reads
    def get_document(self, doc_id: str) -> DocumentRecord | None:
        with self._reading() as ix:
            doc = ix.get_document(doc_id)
        if doc is None and self.mirror is not None and self._resync_if_lost():  # a miss may be a lost mirror
            with self._reading() as ix:
                doc = ix.get_document(doc_id)
        return doc

    def stored_document(self, doc_id: str) -> DocumentRecord | None:
        """The record in LMDB itself (the truth): answers also while a Redis index does not."""
        with self.env.read() as txn:
            return self._record(txn, doc_id)

    def list_documents(self, *, offset: int = 0, limit: int = 50,
                       collection: str | None = None) -> tuple[list[DocumentRecord], int]:
        """(one page in creation order, total count), of one collection if named."""
        if self.mirror is not None:
            self._resync_if_lost()
        with self._reading() as ix:
            return ix.list_documents(max(offset, 0), max(limit, 0), collection)

    def get_text(self, doc_id: str) -> str | None:
        with self.env.read() as txn:
            raw = txn.get(doc_id.encode(), db=self._texts)
            return None if raw is None else bytes(raw).decode()

    # --- what `kvfuse store check` reads and repairs, inside the caller's transaction
    def count(self, txn: lmdb.Transaction) -> int:
        return txn.stat(self._docs)["entries"]

    def documents(self, txn: lmdb.Transaction) -> dict[str, DocumentRecord]:
        return {bytes(k).decode(): DocumentRecord.from_json(v) for k, v in txn.cursor(db=self._docs)}

    def refs(self, txn: lmdb.Transaction) -> set[tuple[str, str]]:
        """Every (chunk key, doc id) reference."""
        return {(bytes(k).decode(), bytes(v).decode()) for k, v in txn.cursor(db=self._refs)}

    def referenced(self, txn: lmdb.Transaction, key: str) -> bool:
        return txn.get(key.encode(), db=self._refs) is not None

    def rewrite_refs(self, txn: lmdb.Transaction, refs: Iterable[tuple[str, str]]) -> None:
        """Replace every reference with `refs` (chunk key, doc id)."""
        if self._refs is None:  # only an older store opened read-only lacks it, and that one is not written
            raise StoreReadOnlyError("this store has no reference table to rewrite")
        txn.drop(self._refs, delete=False)
        for key, doc_id in sorted(refs):
            txn.put(key.encode(), doc_id.encode(), db=self._refs, dupdata=True)

    def snapshot(self) -> IndexSnapshot:
        """The truth, read from LMDB in one transaction, to compare a mirror with."""
        snap = IndexSnapshot()
        with self.env.read() as txn:
            snap.docs = {doc_id: (d.status, d.updated_at) for doc_id, d in self.documents(txn).items()}
            snap.chunks = {key for key, _ in self.blobs.scan(txn)} | {
                i.key for i in self.blobs.infos(txn) if i.evicted_at}  # the index lists evicted chunks too
            owners: dict[str, set[str]] = {}
            for key, doc_id in self.refs(txn):
                if not doc_id.startswith(STAGING_PREFIX):  # a job's staged refs are not mirrored (store/jobs.py)
                    owners.setdefault(key, set()).add(doc_id)
        snap.owners = {k: frozenset(v) for k, v in owners.items()}
        return snap

    def index_available(self) -> bool:
        """Whether document reads can be answered now (a mirror that failed is re-checked, and rebuilt
        if it came back empty)."""
        return self.sync is None or self.sync.available()

    # --- the mirror (a Redis index) kept in step
    def rebuild_index(self) -> dict[str, int | str]:
        """Replace the mirror with the LMDB records (nothing to do when embedded); returns counts."""
        with self.sync.lock if self.sync is not None else nullcontext():
            with self.env.read() as txn:
                docs, chunks = list(self.documents(txn).values()), self.blobs.infos(txn)
            if self.mirror is not None:
                self.mirror.rebuild(self.store_id, docs, chunks)
        return {"index": self.index.kind, "documents": len(docs), "chunks": len(chunks)}

    def _mirror_write(self, written: _Written) -> None:
        self._forget(written.removed)
        if self.mirror is not None:
            with self._mirrored() as m:
                m.put_document(*written)

    @contextmanager
    def _reading(self) -> Iterator[DocumentIndex]:
        if self.sync is None:
            yield self.index
        else:
            with self.sync.use(write=False) as m:
                yield m

    def _mirrored(self) -> AbstractContextManager[IndexMirror]:
        """The mirror for a write (mirror_sync.py: re-checked first if it failed before)."""
        assert self.sync is not None
        return self.sync.use()

    def _resync_if_lost(self) -> bool:
        return self.sync is not None and self.sync.resync_if_lost()

    def _ensure_store_id(self) -> str:
        """Which LMDB store this is, so a mirror of another store (a shared Redis) is never taken for ours."""
        with self.env.read() as txn:
            raw = txn.get(b"store_id", db=self._meta)
            if raw is not None:
                return bytes(raw).decode()
        if self.env.readonly:
            return ""
        new = uuid.uuid4().hex

        def fn(txn: lmdb.Transaction) -> str:
            raw = txn.get(b"store_id", db=self._meta)
            if raw is not None:  # another process got there first
                return bytes(raw).decode()
            txn.put(b"store_id", new.encode(), db=self._meta)
            return new

        return self.env.write(fn)
