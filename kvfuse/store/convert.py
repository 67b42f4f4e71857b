"""`kvfuse store convert --kv-dtype FORMAT`: every stored chunk rewritten in another KV format, in place,
without running the model (docs/DESIGN.md, "Storage"; docs/usage.md).

Each blob in another format is read and its checksum verified, its KV dequantized (or taken as it is,
for a float format) and encoded in FORMAT under its new content key: the same model, tokens, context and
artifacts, so the key differs only in the format. Then one LMDB write transaction per batch stores the
new blobs (each read back and verified inside it), moves every owner's ref from the old key to the new
one, rewrites the records of the documents that own it (their chunk keys and KV bytes) and drops the old
blobs. A batch is all done or not started, so an interrupted run (killed, or stopped by `limit`) leaves a
store that serves every document, some of its chunks in each format (a store may hold several: the
service reads any of them, rag/sources.py); running it again goes on with what is left.

With an object store (object_tier.py), each new blob is listed for upload in that same transaction and
uploaded after it, and the old key's object is listed as an orphan (deleted after `store.orphan_grace_s`).

A Redis index follows each batch: the batch's documents and chunks are written to it once its LMDB
transaction is in, so a service reading meanwhile finds every chunk. A kill can still come between the
two writes, and a catalog's stale flag lives only in its own process, so before the first batch the index
loses its marker (as a rebuild cut short does: store/redis_index.py): until the run ends and rebuilds it,
the next process to open the store, or a service's next miss, listing or readiness probe, rebuilds it
from LMDB. A SIGKILL at any point thus leaves nothing stale for longer than that.

Left alone: blobs an unfinished ingestion job has staged (it stores its chunks in the format configured
when it runs again), orphans (`kvfuse store check` deals with them) and blobs whose header cannot be read
(reported; `kvfuse store check --repair` deletes them). Converting out of a quantized format keeps its
rounding: the values are the quantized ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import lmdb

from kvfuse import kvblob
from kvfuse.kv_formats import dequantize
from kvfuse.store.kvstore import KVStore
from kvfuse.store.lmdb_tier import check_key
from kvfuse.store.records import STAGING_PREFIX, DocumentRecord


@dataclass
class ConvertReport:
    kv_dtype: str
    converted: int = 0  # blobs rewritten in kv_dtype by this run
    remaining: int = 0  # blobs in another format this run did not reach (a limit stopped it)
    bytes_before: int = 0  # of the blobs converted, before and after
    bytes_after: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (key, why)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Converted:
    old: str
    new: str
    blob: bytes
    tokens: int
    old_bytes: int
    owners: list[bytes] = field(default_factory=list)  # the documents whose refs moved to `new`


def pending(store: KVStore, kv_dtype: str) -> tuple[list[str], list[tuple[str, str]]]:
    """(keys of the blobs in another format, (key, why) of those whose header cannot be read)."""
    todo, bad = [], []
    with store.env.read() as txn:
        for key, blob in store.blobs.scan(txn):
            try:
                if kvblob.read_header(blob).dtype != kv_dtype:
                    todo.append(key)
            except kvblob.CorruptBlobError as err:
                bad.append((key, str(err)))
    return todo, bad


def convert_store(store: KVStore, kv_dtype: str, *, batch: int = 16, limit: int | None = None,
                  progress: Callable[[int, int], None] | None = None) -> ConvertReport:
    """Convert up to `limit` blobs (every one when None), `batch` per transaction; `progress(looked at,
    total)` after each batch. `remaining`: blobs in another format this run did not look at."""
    kvblob.check_format(kv_dtype)
    t0 = time.perf_counter()
    rep = ConvertReport(kv_dtype)
    todo, rep.skipped = pending(store, kv_dtype)
    mirror = store.catalog.mirror
    if mirror is not None and todo:
        mirror.invalidate()  # from here until the rebuild below, whoever opens the store rebuilds it
    seen = 0
    while seen < len(todo) and (limit is None or rep.converted < limit):
        take = batch if limit is None else min(batch, limit - rep.converted)
        converted = []
        for key in todo[seen : seen + take]:
            got = _reencode(store, key, kv_dtype)
            if isinstance(got, str):
                rep.skipped.append((key, got))
            else:
                converted.append(got)
        seen += take
        moved, skipped = store.env.write(partial(_swap, store, batch=converted))
        store.chunks.evict([c.old for c in moved])
        if store.objects is not None:
            store.objects.retry_pending()  # what an outage leaves pending is retried in the background
        _mirror_batch(store, moved)
        rep.skipped += skipped
        rep.converted += len(moved)
        rep.bytes_before += sum(c.old_bytes for c in moved)
        rep.bytes_after += sum(len(c.blob) for c in moved)
        if progress is not None:
            progress(min(seen, len(todo)), len(todo))
    rep.remaining = max(0, len(todo) - seen)
    if mirror is not None and todo:
        store.rebuild_index()  # the marker back: the index is the LMDB records again
    rep.seconds = time.perf_counter() - t0
    return rep


def _reencode(store: KVStore, key: str, kv_dtype: str) -> _Converted | str:
    """The blob of `key` in `kv_dtype` (read with its checksum verified), or why it was left alone."""
    with store.env.read() as txn:
        buf = txn.get(key.encode(), db=store.env.db("chunks"))
        if buf is None:
            return "deleted meanwhile"
        old_bytes = len(buf)
        try:
            k, v, header = kvblob.decode(buf, verify=True, copy=True)
            check_key(key, header.key)
        except kvblob.CorruptBlobError as err:
            return f"corrupt: {err}"
    blob = kvblob.reencode(dequantize(k), dequantize(v), header, kv_dtype)
    new = kvblob.read_header(blob).key
    return _Converted(key, new, blob, header.num_tokens, old_bytes)


def _swap(store: KVStore, txn: lmdb.Transaction, batch: list[_Converted]
          ) -> tuple[list[_Converted], list[tuple[str, str]]]:
    """Inside one write transaction: each converted blob stored and verified, its owners moved to the new
    key (documents' records rewritten), the old blob dropped. Returns (moved, skipped with why)."""
    refs, docs, blobs = store.env.db("refs"), store.env.db("docs"), store.blobs
    moved, skipped = [], []
    for c in batch:
        cur = txn.cursor(db=refs)
        owners = [bytes(v) for v in cur.iternext_dup(keys=False)] if cur.set_key(c.old.encode()) else []
        if not owners:
            skipped.append((c.old, "no document refers to it (an orphan: kvfuse store check)"))
            continue
        if any(o.startswith(STAGING_PREFIX.encode()) for o in owners):
            skipped.append((c.old, "staged by an unfinished ingestion job"))
            continue
        if not blobs.stored(txn, c.old):
            skipped.append((c.old, "deleted meanwhile"))
            continue
        blobs.write(txn, c.new, c.blob, c.tokens)
        kvblob.verify_blob(txn.get(c.new.encode(), db=store.env.db("chunks")) or b"")  # what was written reads back
        for owner in owners:
            txn.put(c.new.encode(), owner, db=refs, dupdata=True)
            txn.delete(c.old.encode(), owner, db=refs)
            raw = txn.get(owner, db=docs)
            if raw is not None:
                rec = DocumentRecord.from_json(raw)
                rec.chunk_keys = [c.new if k == c.old else k for k in rec.chunk_keys]
                rec.kv_bytes = max(0, rec.kv_bytes + rec.chunk_keys.count(c.new) * (len(c.blob) - c.old_bytes))
                txn.put(owner, rec.to_json(), db=docs)
        blobs.drop(txn, c.old)
        if store.objects is not None:  # the new blob goes up, the old object after the orphan grace
            store.objects.needs_upload(txn, c.new)
            store.objects.orphaned(txn, c.old)
        c.owners = owners
        moved.append(c)
    return moved, skipped


def _mirror_batch(store: KVStore, moved: list[_Converted]) -> None:
    """A committed batch into the Redis index: each owner's record with its chunks' infos, the old keys
    dropped and their chunks removed."""
    mirror = store.catalog.mirror
    if mirror is None or not moved:
        return
    old_of: dict[bytes, list[str]] = {}
    for c in moved:
        for owner in c.owners:
            old_of.setdefault(owner, []).append(c.old)
    docs = store.env.db("docs")
    with store.env.read() as txn:
        written = []
        for owner, old in old_of.items():
            raw = txn.get(owner, db=docs)
            if raw is not None:
                rec = DocumentRecord.from_json(raw)
                written.append((rec, store.blobs.infos(txn, rec.chunk_keys), old))
    for rec, infos, old in written:
        mirror.put_document(rec, infos, old, old)
    mirror.remove_chunks([c.old for c in moved])
