"""Where a chunk's KV lives: one interface for every tier, and the order in which tiers are read.

Modelled on LMCache's storage backends: each tier answers `contains/get/put/remove` for content keys
(kvfuse.kvblob.chunk_key), and a `TieredStore` composes them fastest first:

    [device tier (hot_tier.HotTier on the GPU) ->]  RAM hot tier (hot_tier.HotTier)  ->
    LMDB blob tier (lmdb_tier.LmdbTier)  [->  shared_tier.RedisTier]  [->  object_tier.ObjectTier]

A read goes down the tiers until one has the chunk and writes it back into every tier above, so the next
read stops higher up (read-through, write-back on a lower-tier hit). A hit in a tier marked
`write_back_async` (the object store) is put into the caches at once but into the storage tiers above on
a background thread, so the query does not wait for LMDB's synced write. A put goes to the storage tiers
below the caches, and only clears the caches' copies: a freshly computed chunk is not necessarily about to
be read, and the hot tier is kept for what queries read. A miss in every tier is the caller's to rebuild
from the chunk's token ids.

Every tier deals in the same value, the decoded chunk `kvblob.ChunkEntry` (k, v, header): tiers that keep bytes pack it
(kvfuse.kvblob.pack) and decode what they read. Keys are content-addressed, so a copy in any tier is as
good as any other; tiers that keep bytes verify what they read and raise CorruptBlobError on damage.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from kvfuse.kv_formats import cat_tokens, token_slice
from kvfuse.kvblob import BLOCK_TOKENS, ChunkEntry, KVHeader

log = logging.getLogger(__name__)


def slice_blocks(entry: ChunkEntry, blocks: list[int]) -> ChunkEntry:
    """The tokens of `blocks` (sorted indices of the header's blocks) of a decoded chunk, copied (a quantized
    chunk's scales with them: kvfuse.kv_formats.token_slice)."""
    k, v, header = entry
    t = header.block_tokens or BLOCK_TOKENS
    spans = [(b * t, min((b + 1) * t, header.num_tokens)) for b in blocks]
    return ChunkEntry(cat_tokens([token_slice(k, a, z) for a, z in spans], k),
                      cat_tokens([token_slice(v, a, z) for a, z in spans], v), header)


class ChunkStore(ABC):
    """One place chunk KV can be kept. Entries handed out may be shared: callers never modify them."""

    name: str
    write_back_async = False  # a hit here is written into the storage tiers above in the background

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Whether `get` would find the chunk (a probe: no counters move, nothing is read)."""

    @abstractmethod
    def get(self, key: str) -> ChunkEntry | None:
        """The chunk, or None on a miss; raises CorruptBlobError for a damaged copy."""

    @abstractmethod
    def put(self, key: str, entry: ChunkEntry) -> bool:
        """Keep the chunk under its content key; False when it was not added (already there, too big)."""

    @abstractmethod
    def remove(self, key: str) -> bool:
        """Drop the chunk; False when this tier did not have it."""

    # Block reads (docs/methods/samkv.md, "Sparse loading"). The defaults read the whole chunk; a tier that
    # keeps bytes overrides them to read only what is asked for.
    def get_blocks(self, key: str, blocks: list[int]) -> tuple[ChunkEntry, int] | None:
        """((k, v, header) of the tokens of `blocks` only, bytes read from this tier), or None on a miss."""
        entry = self.get(key)
        if entry is None:
            return None
        return slice_blocks(entry, blocks), entry.k.nbytes + entry.v.nbytes

    def get_artifacts(self, key: str) -> KVHeader | None:
        """The chunk's header with its artifacts (None in it for a version-1 blob), or None on a miss."""
        entry = self.get(key)
        return None if entry is None else entry.header

    def size(self, key: str) -> int | None:
        """The bytes this tier keeps for the chunk, in the format it was stored in (None: not here, or not
        known without reading it). The reload policy's estimate of a read (reload_policy.py)."""
        return None

    def probe_read(self) -> tuple[int, float] | None:
        """(bytes, seconds) of one read as this tier reads a chunk, to measure it before any query does
        (the worker's reload-or-recompute policy); None where there is nothing to read or it is memory."""
        return None


def entry_bytes(entry: ChunkEntry) -> int:
    """The bytes a decoded chunk holds (a quantized one's codes and scales)."""
    return entry.k.nbytes + entry.v.nbytes


class TieredStore(ChunkStore):
    """Cache tiers over storage tiers, read in that order (see the module docstring): the first `caches`
    tiers given are caches. Reads may run on several threads at once (KVStore.load_chunks)."""

    name = "tiered"

    def __init__(self, *tiers: ChunkStore, caches: int = 1) -> None:
        if len(tiers) <= caches or caches < 1:
            raise ValueError("a tiered store needs a cache and at least one storage tier under it")
        self.caches, self.stores = tiers[:caches], tiers[caches:]
        self.cache = self.caches[-1]  # the lowest cache (the RAM tier)
        self.tiers: tuple[ChunkStore, ...] = tiers
        # Reads served by each tier, and misses in all of them (what shows where KV came from).
        self.hits: dict[str, int] = {t.name: 0 for t in self.tiers} | {"miss": 0}
        self._count = threading.Lock()
        # Told (tier name, bytes, seconds) of every read a tier served: the worker's measured bandwidths.
        self.observer: Callable[[str, int, float], None] | None = None
        self._writer: ThreadPoolExecutor | None = None  # write-backs off the query's path (one thread: in order)
        self._writer_lock = threading.Lock()

    def contains(self, key: str) -> bool:
        return any(t.contains(key) for t in self.tiers)

    def where(self, key: str) -> str | None:
        """The name of the first tier that has the chunk (where `get` would read it), None for none."""
        return next((t.name for t in self.tiers if t.contains(key)), None)

    def locate(self, key: str) -> tuple[str | None, int | None]:
        """(the first tier that has the chunk, its bytes there as stored: `size`), (None, None) for none."""
        for t in self.tiers:
            if t.contains(key):
                return t.name, t.size(key)
        return None, None

    def get(self, key: str) -> ChunkEntry | None:
        for i, tier in enumerate(self.tiers):
            t0 = time.perf_counter()
            entry = tier.get(key)
            if entry is not None:
                if self.observer is not None:
                    self.observer(tier.name, entry_bytes(entry), time.perf_counter() - t0)
                with self._count:
                    self.hits[tier.name] += 1
                for upper in reversed(self.tiers[:i]):  # the RAM tier first: the device tier copies from it
                    if tier.write_back_async and upper in self.stores:
                        self._write_back(upper, key, entry)
                    else:
                        upper.put(key, entry)
                return entry
        with self._count:
            self.hits["miss"] += 1
        return None

    def _write_back(self, tier: ChunkStore, key: str, entry: ChunkEntry) -> None:
        def put() -> None:
            try:
                tier.put(key, entry)
            except Exception:  # noqa: BLE001 - a copy that failed is only a later miss
                log.exception("writing chunk %s back into the %s tier failed", key[:16], tier.name)

        with self._writer_lock:
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvfuse-write-back")
            self._writer.submit(put)

    def drain(self) -> None:
        """Wait until every background write-back submitted so far is done."""
        with self._writer_lock:
            writer = self._writer
        if writer is not None:
            writer.submit(lambda: None).result()

    def close(self) -> None:
        """Finish the background write-backs."""
        with self._writer_lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.shutdown(wait=True)

    def get_blocks(self, key: str, blocks: list[int]) -> tuple[ChunkEntry, int] | None:
        """Blocks from the first tier that has the chunk; a partial read is not written back up."""
        for tier in self.tiers:
            got = tier.get_blocks(key, blocks)
            if got is not None:
                return got
        return None

    def get_artifacts(self, key: str) -> KVHeader | None:
        for tier in self.tiers:
            header = tier.get_artifacts(key)
            if header is not None:
                return header
        return None

    def put(self, key: str, entry: ChunkEntry) -> bool:
        added = [store.put(key, entry) for store in self.stores]
        for cache in self.caches:
            cache.remove(key)
        return any(added)

    def remove(self, key: str) -> bool:
        return any([t.remove(key) for t in self.tiers])  # a list: every tier, not the first that had it

    def evict(self, keys: Iterable[str]) -> None:
        """Forget the cached copies of chunks a storage tier dropped by its own rules (the last document
        using them went): the storage tiers are not touched again."""
        for key in keys:
            for cache in self.caches:
                cache.remove(key)
