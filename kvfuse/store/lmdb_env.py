"""The store's LMDB environment: one file on SSD holding every named database, the source of truth.

Named databases (the module that owns each):
  chunks     chunk key -> KV blob (kvfuse.kvblob), content-addressed, stored once     lmdb_tier
  chunkinfo  chunk key -> JSON {tokens, bytes, created_at}                             lmdb_tier
  refs       chunk key -> doc id (dupsort): which documents use a chunk               catalog
  docs       doc id -> JSON DocumentRecord                                             catalog
  doctime    created_at (8 bytes, big-endian ns) + doc id -> b"" (creation order)      catalog, index
  texts      doc id -> UTF-8 text (KV can always be rebuilt from it)                   catalog
  meta       kv_bytes (lmdb_tier), store_id (catalog), model_fingerprint (the worker's, for check)
  jobs       job id -> JSON JobRecord (durable ingestion jobs, with their text)           jobs
  objpending chunk key -> time: not yet known to be in the object store                 object_tier
  objorphans chunk key -> time: no document uses it; its object goes after the grace    object_tier

Concurrency: LMDB allows many reader processes and one writer; every write is one transaction, so a
document and the blobs it drops change together. Within a process, `set_mapsize` (growing the map)
must not run while any transaction is open, so every transaction passes a gate that a resize closes.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import lmdb

from kvfuse.store.errors import StoreError, StoreReadOnlyError

log = logging.getLogger(__name__)
T = TypeVar("T")

DB_NAMES = ("chunks", "chunkinfo", "refs", "docs", "doctime", "texts", "meta", "jobs", "objpending", "objorphans")
_ADDED_LATER = ("jobs", "objpending", "objorphans")  # a store written before these existed still opens read-only (they read as empty)
_READONLY_ERRNOS = (errno.EACCES, errno.EROFS, errno.EPERM)
_MAX_WRITE_ATTEMPTS = 32  # map doublings before giving up (1 MB -> 4 PB)


class _Gate:
    """Any number of transactions at once, or one map resize alone."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._resizing = False
        self._mine = threading.local()  # transactions this thread holds

    @contextmanager
    def txn(self) -> Iterator[None]:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._active += 1
        self._mine.n = getattr(self._mine, "n", 0) + 1
        try:
            yield
        finally:
            self._mine.n -= 1
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        if getattr(self._mine, "n", 0):  # waiting for our own transaction to end would never return
            raise StoreError("the LMDB map must be resized while this thread holds a read transaction; end it and retry")
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._resizing = True
            while self._active:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()


def _readonly_error(path: Path, err: BaseException) -> StoreReadOnlyError:
    return StoreReadOnlyError(
        f"the store directory {path} is not writable ({err}); set data_dir (KVFUSE_DATA_DIR) to a writable "
        "directory, or open the store read-only"
    )


class LmdbEnv:
    """The environment, its named databases, transactions, and the map that grows instead of failing."""

    def __init__(self, path: Path, *, map_size: int, max_readers: int, readonly: bool = False) -> None:
        self.path = Path(path)
        self.readonly = readonly
        self._gate = _Gate()
        if readonly and not (self.path / "data.mdb").is_file():
            raise StoreError(f"no store at {self.path} (nothing was ever written there)")
        try:
            if not readonly:
                self.path.mkdir(parents=True, exist_ok=True)
            self.env = lmdb.open(
                str(self.path),
                map_size=map_size,
                max_dbs=len(DB_NAMES) + 1,
                max_readers=max_readers,
                readonly=readonly,
                subdir=True,
                # readahead stays on: a chunk blob is MBs read front to back; without it a cold read from
                # disk faults in one 4 KB page at a time
                # metasync/sync stay on: a committed document survives a power loss
            )
        except OSError as err:
            if err.errno in _READONLY_ERRNOS:
                raise _readonly_error(self.path, err) from None
            raise StoreError(f"cannot open the store at {self.path}: {err}") from err
        except lmdb.Error as err:
            # py-lmdb reports the errno only as text ("...: Permission denied", "...: Read-only file system")
            if isinstance(err, lmdb.ReadonlyError) or "Permission denied" in str(err) or "Read-only" in str(err):
                raise _readonly_error(self.path, err) from None
            raise StoreError(f"cannot open the store at {self.path}: {err}") from err
        self.dbs: dict[str, lmdb._Database | None] = {}
        for name in DB_NAMES:
            try:
                self.dbs[name] = self.env.open_db(name.encode(), create=not readonly, dupsort=name == "refs")
            except lmdb.NotFoundError:
                if name in _ADDED_LATER:
                    self.dbs[name] = None
                    continue
                self.env.close()
                raise StoreError(f"the store at {self.path} is incomplete or from another program") from None

    def db(self, name: str) -> lmdb._Database | None:
        """The named database (None only for one added later, in an older store opened read-only)."""
        return self.dbs[name]

    def _adopt_new_size(self) -> None:
        # Another process grew the map: adopt its size (0 = the size recorded in the file).
        with self._gate.exclusive():
            self.env.set_mapsize(0)

    @contextmanager
    def read(self) -> Iterator[lmdb.Transaction]:
        """A read transaction whose values are zero-copy buffers, valid only inside the `with` block."""
        for _ in range(3):
            with self._gate.txn():
                try:
                    txn = self.env.begin(buffers=True)
                except lmdb.MapResizedError:
                    txn = None
                if txn is not None:
                    try:
                        yield txn
                    finally:
                        txn.abort()
                    return
            self._adopt_new_size()
        raise StoreError(f"the LMDB map at {self.path} keeps being resized; retry")

    def write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run `fn` in one write transaction and commit. On a full map: abort, grow the map, run `fn`
        again (so `fn` must only act through the transaction)."""
        if self.readonly:
            raise StoreReadOnlyError(f"the store at {self.path} was opened read-only")
        for _ in range(_MAX_WRITE_ATTEMPTS):
            try:
                with self._gate.txn():
                    with self.env.begin(write=True, buffers=True) as txn:  # commits on success, aborts on error
                        return fn(txn)
            except lmdb.MapFullError:
                self._grow()
            except lmdb.MapResizedError:
                self._adopt_new_size()
            except lmdb.ReadonlyError as err:
                raise _readonly_error(self.path, err) from None
            except lmdb.DiskError as err:
                raise StoreError(f"disk error writing the store at {self.path}: {err}") from err
        raise StoreError(f"could not grow the LMDB map at {self.path} enough to write")

    def _grow(self) -> None:
        with self._gate.exclusive():
            old = self.env.info()["map_size"]
            new = old * 2
            self.env.set_mapsize(new)
        log.info("LMDB map at %s grown from %d MB to %d MB", self.path, old >> 20, new >> 20)

    def sizes(self) -> dict[str, int]:
        """The map's size and how much of it is used (both grow; see `write`)."""
        info, st = self.env.info(), self.env.stat()
        return {"lmdb_map_bytes": info["map_size"], "lmdb_used_bytes": (info["last_pgno"] + 1) * st["psize"]}

    def close(self) -> None:
        self.env.close()
