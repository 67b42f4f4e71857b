"""The LMDB blob tier: chunk KV blobs on SSD, the tier every other one is filled from.

It owns the `chunks` (key -> blob) and `chunkinfo` (key -> tokens, bytes, created_at) databases and the
`kv_bytes` counter of the environment it shares with the document catalog (lmdb_env.py).

Reads parse the blob straight out of LMDB's memory map and copy the payload once (checksummed block by
block as it is copied) into tensors they own, because an LMDB buffer dies with its read transaction,
and a read transaction held while the tensors are used would pin old pages and stop the writer from
reusing them.

A blob goes when the last document using it goes, in the catalog's transaction: the methods that take
a `txn` are those steps, for the catalog and for `kvfuse store check`. `remove` is the tier's own
unconditional delete; the catalog never uses it, since a blob must not go while a document refers to it.

With a budget (`store.lmdb_budget_mb`, lmdb_budget.py) a put past it evicts the policy's victims in its own
transaction. An evicted chunk that a document (or a job's staged version) still refers to keeps its
info, marked `evicted_at`: the store still knows it (a `ready` document may use it, `kvfuse store check`
does not call it lost), and a query rebuilds it from its token ids or reads it from a lower tier. An
unreferenced one (a fleet worker's cache) goes whole.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import replace

import lmdb

from kvfuse.kvblob import (
    ChunkEntry,
    CorruptBlobError,
    KVHeader,
    decode,
    pack,
    read_artifacts,
    read_blocks,
    read_header,
    verify_blob,
)
from kvfuse.store.chunk_store import ChunkStore, slice_blocks
from kvfuse.store.lmdb_budget import LmdbBudget
from kvfuse.store.lmdb_env import LmdbEnv
from kvfuse.store.records import ChunkInfo

log = logging.getLogger(__name__)


def check_key(key: str, header_key: str) -> None:
    """A blob under a key that is not its own would be served for the wrong chunk."""
    if header_key != key:
        raise CorruptBlobError(f"blob stored under {key} belongs under {header_key}")


class LmdbTier(ChunkStore):
    name = "lmdb"

    def __init__(self, env: LmdbEnv, *, verify: bool = True, pin: bool = False,
                 budget: LmdbBudget | None = None) -> None:
        """pin: decode into page-locked memory (a CUDA worker: its GPU then copies the KV without a
        staging copy, and the RAM hot tier above keeps it so). budget: bound the blobs' bytes."""
        self.env = env
        self._verify = verify
        self._pin = pin
        self._blobs = env.db("chunks")
        self._infos = env.db("chunkinfo")
        self._meta = env.db("meta")
        self._refs = env.db("refs")
        self.budget = budget
        # Set by KVStore with an object store below: a chunk the budget must not evict yet (in txn).
        self.keep: Callable[[lmdb.Transaction, str], bool] | None = None
        if budget is not None:
            with env.read() as txn:
                budget.seed(i for i in self.infos(txn) if not i.evicted_at)

    # --- ChunkStore
    def contains(self, key: str) -> bool:
        with self.env.read() as txn:
            return self.stored(txn, key)

    def get(self, key: str) -> ChunkEntry | None:
        with self.env.read() as txn:
            buf = txn.get(key.encode(), db=self._blobs)
            if buf is None:
                return None
            entry = decode(buf, verify=self._verify, copy=True, pin=self._pin)  # the one copy, before the txn ends
        check_key(key, entry.header.key)
        if self.budget is not None:
            self.budget.accessed(key)
        return entry

    def size(self, key: str) -> int | None:
        """The stored blob's bytes (its chunkinfo: what a read copies, in its own KV format)."""
        with self.env.read() as txn:
            info = self.info(txn, key)
        return None if info is None else info.bytes

    def probe_read(self) -> tuple[int, float] | None:
        """A read of the first stored blob, timed (None: the store holds none)."""
        with self.env.read() as txn:
            first = next(txn.cursor(db=self._blobs).iternext(keys=True, values=False), None)
        if first is None:
            return None
        t0 = time.perf_counter()
        try:
            entry = self.get(bytes(first).decode())
        except CorruptBlobError:
            return None
        return (None if entry is None else (entry.k.nbytes + entry.v.nbytes, time.perf_counter() - t0))

    def fingerprint(self, key: str) -> str | None:
        """The model fingerprint in the blob's header, read without its payload (None: absent or unreadable)."""
        with self.env.read() as txn:
            buf = txn.get(key.encode(), db=self._blobs)
            if buf is None:
                return None
            try:
                return read_header(buf).model_fingerprint
            except CorruptBlobError:
                return None

    def get_blocks(self, key: str, blocks: list[int]) -> tuple[ChunkEntry, int] | None:
        """Copy only the blocks' bytes out of the memory map (each block checked against its checksum); a
        version-1 blob has no blocks, so it is read whole and sliced."""
        with self.env.read() as txn:
            buf = txn.get(key.encode(), db=self._blobs)
            if buf is None:
                return None
            header = read_header(buf)
            if header.block_tokens:
                entry = read_blocks(buf, blocks, verify=self._verify)
                nbytes = entry.k.nbytes + entry.v.nbytes
            else:
                full = decode(buf, verify=self._verify, copy=True)
                entry, nbytes = slice_blocks(full, blocks), header.payload_bytes
        check_key(key, entry.header.key)
        if self.budget is not None:
            self.budget.accessed(key)
        return entry, nbytes

    def get_artifacts(self, key: str) -> KVHeader | None:
        with self.env.read() as txn:
            buf = txn.get(key.encode(), db=self._blobs)
            if buf is None:
                return None
            header = read_artifacts(buf, verify=self._verify)[0]
        check_key(key, header.key)
        return header

    def put(self, key: str, entry: ChunkEntry) -> bool:
        """Store the chunk; False if a valid copy is already there (a corrupt one is replaced)."""
        k, v, header = entry
        if header.key != key:
            raise ValueError(f"blob belongs under key {header.key}, not {key}")
        blob = pack(k, v, header)
        return self.env.write(lambda txn: self.write(txn, key, blob, header.num_tokens))

    def remove(self, key: str) -> bool:
        if not self.contains(key):  # no write transaction (and its sync) for nothing
            return False
        return self.env.write(lambda txn: self.drop(txn, key))

    # --- steps inside a caller's transaction
    def stored(self, txn: lmdb.Transaction, key: str) -> bool:
        return txn.get(key.encode(), db=self._blobs) is not None

    def evicted(self, txn: lmdb.Transaction, key: str) -> bool:
        """Whether the budget evicted the chunk while something still refers to it (its info says so)."""
        info = self.info(txn, key)
        return info is not None and bool(info.evicted_at) and not self.stored(txn, key)

    def write(self, txn: lmdb.Transaction, key: str, blob: bytes, tokens: int) -> bool:
        """Store `blob` under `key`; False if a valid copy is already there (a corrupt one is replaced),
        or if the blob alone is larger than the budget (then its chunk counts as evicted)."""
        kb = key.encode()
        existing = txn.get(kb, db=self._blobs)
        if existing is not None:
            try:
                verify_blob(existing)
                return False
            except CorruptBlobError as err:
                log.warning("replacing corrupt blob %s: %s", key, err)
            self._add_kv_bytes(txn, -len(existing))
            txn.delete(kb, db=self._blobs)
        info = ChunkInfo(key=key, tokens=tokens, bytes=len(blob), created_at=time.time())
        if self.budget is not None and not self._make_room(txn, key, len(blob)):
            txn.put(kb, replace(info, evicted_at=info.created_at).to_json(), db=self._infos)
            return False
        txn.put(kb, blob, db=self._blobs)
        txn.put(kb, info.to_json(), db=self._infos)
        self._add_kv_bytes(txn, len(blob))
        if self.budget is not None:
            self.budget.stored(key, len(blob), tokens)
        return True

    def _make_room(self, txn: lmdb.Transaction, key: str, nbytes: int) -> bool:
        """Evict until `nbytes` more fit under the budget: the policy's victims, then (blobs this process
        does not track) any unpinned blob in key order. A chunk `keep` holds (one the object store below
        has not taken yet: object_tier.py) is skipped and stays tracked. False when they cannot fit."""
        assert self.budget is not None
        if nbytes > self.budget.budget_bytes:
            return False
        over = self.kv_bytes(txn) + nbytes - self.budget.budget_bytes
        kept: set[str] = set()
        try:
            while over > 0:
                victims = self.budget.victims(over, kept) or self._untracked_victim(txn, key, kept)
                if not victims:
                    return False
                for victim in victims:
                    if victim == key:
                        continue
                    if self.keep is not None and self.keep(txn, victim):
                        kept.add(victim)
                        continue
                    over -= self.evict(txn, victim)
            return True
        finally:
            for k in kept:  # back into the policy: the next put may evict them once they are uploaded
                info = self.info(txn, k)
                if info is not None:
                    self.budget.stored(k, info.bytes, info.tokens)

    def _untracked_victim(self, txn: lmdb.Transaction, key: str, kept: Container[str]) -> list[str]:
        assert self.budget is not None
        for kb in txn.cursor(db=self._blobs).iternext(keys=True, values=False):
            k = bytes(kb).decode()
            if k != key and k not in kept and not self.budget.is_pinned(k):
                return [k]
        return []

    def evict(self, txn: lmdb.Transaction, key: str) -> int:
        """Drop the chunk's blob under the budget; its info stays, marked evicted, while anything refers
        to it. Returns the bytes freed."""
        kb = key.encode()
        blob = txn.get(kb, db=self._blobs)
        if blob is None:
            return 0
        nbytes = len(blob)
        self._add_kv_bytes(txn, -nbytes)
        txn.delete(kb, db=self._blobs)
        info = self.info(txn, key)
        if info is not None and txn.get(kb, db=self._refs) is not None:
            txn.put(kb, replace(info, evicted_at=time.time()).to_json(), db=self._infos)
        else:
            txn.delete(kb, db=self._infos)
        if self.budget is not None:
            self.budget.counted(nbytes)
        return nbytes

    def drop(self, txn: lmdb.Transaction, key: str) -> bool:
        """Delete the blob and its info (an evicted chunk's info too); False if neither was there."""
        kb = key.encode()
        blob = txn.get(kb, db=self._blobs)
        had_info = txn.delete(kb, db=self._infos)
        if self.budget is not None:
            self.budget.removed(key)
        if blob is None:
            return had_info
        self._add_kv_bytes(txn, -len(blob))
        txn.delete(kb, db=self._blobs)
        return True

    def info(self, txn: lmdb.Transaction, key: str) -> ChunkInfo | None:
        raw = txn.get(key.encode(), db=self._infos)
        return None if raw is None else ChunkInfo.from_json(key, raw)

    def infos(self, txn: lmdb.Transaction, keys: Iterable[str] | None = None) -> list[ChunkInfo]:
        """Infos of the known chunks among `keys` (each once), or of every known chunk: stored, or evicted
        by the budget. An info whose blob is gone otherwise (damage behind the store's back) is not one."""
        if keys is None:
            keys = (bytes(k).decode() for k in txn.cursor(db=self._infos).iternext(keys=True, values=False))
        found = [self.info(txn, k) for k in dict.fromkeys(keys)]
        return [i for i in found if i is not None and (i.evicted_at or self.stored(txn, i.key))]

    def scan(self, txn: lmdb.Transaction) -> Iterator[tuple[str, bytes | memoryview]]:
        """(key, blob) of every stored chunk; the blobs are views valid inside the transaction only."""
        for kb, blob in txn.cursor(db=self._blobs):
            yield bytes(kb).decode(), blob

    def count(self, txn: lmdb.Transaction) -> int:
        return txn.stat(self._blobs)["entries"]

    def kv_bytes(self, txn: lmdb.Transaction) -> int:
        """The running total of blob bytes (kept by every put and drop; `recount` sets it from scratch)."""
        raw = txn.get(b"kv_bytes", db=self._meta)
        return int(bytes(raw)) if raw is not None else 0

    def recount(self, txn: lmdb.Transaction) -> int:
        """Drop infos without a blob (but those the budget evicted) and set kv_bytes to the real sum;
        returns that sum."""
        stale = [bytes(k) for k, v in txn.cursor(db=self._infos)
                 if txn.get(bytes(k), db=self._blobs) is None and not ChunkInfo.from_json("", v).evicted_at]
        for k in stale:
            txn.delete(k, db=self._infos)
        total = sum(len(blob) for _, blob in self.scan(txn))
        txn.put(b"kv_bytes", str(total).encode(), db=self._meta)
        return total

    def _add_kv_bytes(self, txn: lmdb.Transaction, delta: int) -> None:
        total = self.kv_bytes(txn) + delta
        txn.put(b"kv_bytes", str(max(total, 0)).encode(), db=self._meta)
