"""Chunk KV in an S3-compatible object store: the tier beneath every host's tiers (docs/DESIGN.md, "Storage").

    embedded:      hot -> LMDB -> object
    fleet worker:  hot -> LMDB -> [Redis shared tier] -> object

One object per chunk, named by its content key (kvfuse.kvblob.chunk_key) under the URL's prefix, holding
the blob exactly as LMDB keeps it (kvfuse.kvblob.pack), so its checksums are verified on every read
(CorruptBlobError: the chunk is rebuilt). A PUT is atomic in S3: an object is there whole or not at all,
so a half-written one is never read. Every chunk stored on a host is written through (TieredStore.put),
so a chunk LMDB drops (a budget's eviction) is still here; a hit here is written into the tiers above
in the background (TieredStore: `write_back_async`).

Durable lists in the host's LMDB (lmdb_env.py), so that a killed process loses no work:
  objpending  key -> time: a chunk not yet known to be in the object store. Marked before its PUT and
              cleared after it; the PUTs that failed (the store down) are tried again every
              `object_store.write_retry_s` from the host's LMDB copy, until it is there or gone.
  objorphans  key -> time: the last document using the chunk went (marked in the catalog's own
              transaction). After `store.orphan_grace_s` the object is deleted, unless the chunk is
              referenced or stored again; one stored again meanwhile is uploaded again.

An object store that does not answer: a read is a miss (the chunk is recomputed), a write stays
pending, a delete stays listed; nothing fails the query or the ingestion, and after a short back-off
the tier is tried again, so it serves again as soon as the store is back.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable

import lmdb

from kvfuse.kvblob import ChunkEntry, CorruptBlobError, decode, pack
from kvfuse.store.chunk_store import ChunkStore
from kvfuse.store.lmdb_env import LmdbEnv
from kvfuse.store.s3_client import ObjectStoreError, S3Client

log = logging.getLogger(__name__)
BACKOFF_S = 2.0  # after a failed request the tier answers "unavailable" at once for this long
PROBE_BYTES = 1 << 20  # what a worker reads at start to measure the tier when it holds no chunk yet
_WARN_EVERY_S = 60.0


class ObjectTier(ChunkStore):
    name = "object"
    write_back_async = True  # a hit is copied into the tiers above off the query's path

    def __init__(self, client: S3Client, env: LmdbEnv | None = None, *, verify: bool = True,
                 retry_s: float = 30.0, grace_s: float = 3600.0) -> None:
        self.client = client
        self.env = env
        self._verify = verify
        self.retry_s, self.grace_s = retry_s, grace_s
        self._pending = env.db("objpending") if env is not None else None
        self._orphans = env.db("objorphans") if env is not None else None
        self._lock = threading.Lock()
        self.counters = {"hits": 0, "misses": 0, "puts": 0, "deletes": 0, "corrupt": 0, "errors": 0,
                         "retried": 0}
        self._down_until = 0.0
        self._warned = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Set by KVStore: the host's own copy of a chunk (re-uploads), and whether a chunk is in use
        # (referenced or stored) inside a transaction (deletes).
        self.local_copy: Callable[[str], ChunkEntry | None] = lambda key: None
        self.in_use: Callable[[lmdb.Transaction, str], bool] = lambda txn, key: True

    # --- availability
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, err: Exception) -> None:
        self._count("errors")
        self._down_until = time.monotonic() + BACKOFF_S
        if time.monotonic() - self._warned > _WARN_EVERY_S:
            self._warned = time.monotonic()
            log.warning("the object store is unavailable (%s): reads are recomputed, writes retried: %s", what, err)

    # --- ChunkStore
    def contains(self, key: str) -> bool:
        if not self.available():
            return False
        try:
            return self.client.exists(key)
        except ObjectStoreError as err:
            self._failed("head", err)
            return False

    def get(self, key: str) -> ChunkEntry | None:
        if not self.available():
            self._count("misses")
            return None
        try:
            blob = self.client.get(key)
        except ObjectStoreError as err:
            self._failed("get", err)
            self._count("misses")
            return None
        if blob is None:
            self._count("misses")
            return None
        try:
            entry = decode(blob, verify=self._verify, copy=True)
            if entry.header.key != key:
                raise CorruptBlobError(f"object {key} holds the blob of {entry.header.key}")
        except CorruptBlobError:
            self._count("corrupt")
            raise
        self._count("hits")
        return entry

    def put(self, key: str, entry: ChunkEntry) -> bool:
        """Upload the chunk, listed as pending until the PUT is answered; False if it was there already
        (a HEAD first: content-addressed, so the object there is this chunk) or stays pending."""
        k, v, header = entry
        if header.key != key:
            raise ValueError(f"blob belongs under key {header.key}, not {key}")
        self._mark(key, pending=True)
        try:
            there = self.available() and self.client.exists(key)
        except ObjectStoreError as err:
            self._failed("head", err)
            return False
        if not there and not self._upload(key, pack(k, v, header)):
            return False
        self._mark(key, pending=False)
        return not there

    def remove(self, key: str) -> bool:
        try:
            self.client.delete(key)
        except ObjectStoreError as err:
            self._failed("delete", err)
            return False
        self._count("deletes")
        return True

    def probe_read(self) -> tuple[int, float] | None:
        """A GET of a chunk-sized probe object of this host's own, timed, then deleted (None: the store
        does not answer)."""
        key = f"probe-{uuid.uuid4().hex}"
        try:
            self.client.put(key, os.urandom(PROBE_BYTES))
            t0 = time.perf_counter()
            got = self.client.get(key)
            seconds = time.perf_counter() - t0
            self.client.delete(key)
        except ObjectStoreError as err:
            self._failed("probe", err)
            return None
        return (len(got), seconds) if got else None

    def _upload(self, key: str, blob: bytes) -> bool:
        if not self.available():
            return False
        try:
            self.client.put(key, blob)
        except ObjectStoreError as err:
            self._failed("put", err)
            return False
        self._count("puts")
        return True

    # --- the durable lists
    def _mark(self, key: str, *, pending: bool) -> None:
        if self.env is None:
            return
        kb = key.encode()

        def fn(txn: lmdb.Transaction) -> None:
            if pending:
                txn.put(kb, str(time.time()).encode(), db=self._pending)
                txn.delete(kb, db=self._orphans)  # stored again: no longer to be deleted
            else:
                txn.delete(kb, db=self._pending)

        self.env.write(fn)

    def needs_upload(self, txn: lmdb.Transaction, key: str) -> None:
        """List `key` as pending in `txn` (a chunk stored in LMDB by a caller's transaction: `store
        convert`, `store check --repair`); `retry_pending` uploads it."""
        if self._pending is not None:
            txn.put(key.encode(), str(time.time()).encode(), db=self._pending)
            txn.delete(key.encode(), db=self._orphans)

    def is_pending(self, txn: lmdb.Transaction, key: str) -> bool:
        """Whether `key` is listed for upload in `txn` (the host's copy is the only one yet)."""
        return self._pending is not None and txn.get(key.encode(), db=self._pending) is not None

    def orphaned(self, txn: lmdb.Transaction, key: str) -> None:
        """The last reference to `key` went in `txn` (the catalog's): its object is deleted after the grace."""
        if self._orphans is not None:
            txn.put(key.encode(), str(time.time()).encode(), db=self._orphans)

    def listed(self, which: str) -> dict[str, float]:
        """The `pending` or `orphans` list: key -> when it was listed."""
        db = self._pending if which == "pending" else self._orphans
        if db is None:
            return {}
        with self.env.read() as txn:  # type: ignore[union-attr]
            return {bytes(k).decode(): float(bytes(v)) for k, v in txn.cursor(db=db)}

    def retry_pending(self) -> int:
        """Upload the pending chunks the host still holds (a chunk it no longer holds is dropped from the
        list: it is rebuilt from its tokens where it is needed); returns how many went up."""
        done = 0
        for key in self.listed("pending"):
            if not self.available():
                break
            entry = self.local_copy(key)
            if entry is not None and not self._upload(key, pack(*entry)):
                break
            self._mark(key, pending=False)
            done += entry is not None
        self._count("retried", done)
        return done

    def reap_orphans(self, now: float | None = None) -> int:
        """Delete the objects of chunks orphaned longer than the grace ago and still unused; returns how
        many. One stored or referenced again after its delete is uploaded again (pending)."""
        now = time.time() if now is None else now
        deleted = 0
        for key, since in self.listed("orphans").items():
            if now - since < self.grace_s or not self.available():
                continue
            with self.env.read() as txn:  # type: ignore[union-attr]
                used = self.in_use(txn, key)
            if not used and not self.remove(key):
                break  # the store is down: the entry stays listed
            deleted += not used
            kb = key.encode()

            def fn(txn: lmdb.Transaction, kb: bytes = kb, key: str = key, gone: bool = not used) -> bool:
                txn.delete(kb, db=self._orphans)
                if gone and self.in_use(txn, key):  # stored again while it was being deleted
                    txn.put(kb, str(time.time()).encode(), db=self._pending)
                    return True
                return False

            if self.env.write(fn):  # type: ignore[union-attr]
                self.retry_pending()
        return deleted

    # --- housekeeping
    def start(self) -> None:
        """Retry pending uploads and reap orphans in the background, every write_retry_s."""
        if self.env is None or self.env.readonly or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="kvfuse-object-store", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.retry_s):
            try:
                self.retry_pending()
                self.reap_orphans()
            except Exception:  # noqa: BLE001 - housekeeping must never end; it is tried again
                log.exception("object store housekeeping failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = {f"object_{k}": v for k, v in self.counters.items()}
        return out | {"object_pending": len(self.listed("pending")), "object_orphans": len(self.listed("orphans"))}
