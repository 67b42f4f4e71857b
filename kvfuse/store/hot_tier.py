"""RAM tier in front of LMDB: decoded chunk KV, least recently used evicted first, bounded in bytes.

It lives in the worker process, which reads KV; tensors it hands out are shared, never copied.

The same class is the device tier above it (`store.device_tier_mb`): given a device, it keeps its
entries there (on a CUDA worker, GPU memory: a hit then needs no copy to the device at all, the
LayerLoader reads the layers in place). On a CPU worker the device is the host and entries are kept
as they come (the tests run it so)."""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvfuse.kvblob import ChunkEntry
from kvfuse.store.chunk_store import ChunkStore, slice_blocks


class HotTier(ChunkStore):
    """Thread-safe LRU by bytes. Entries are shared with callers, who must not modify them in place."""

    def __init__(self, budget_bytes: int, *, device: str | None = None, name: str = "hot") -> None:
        """device: where entries are kept (None: as they come, in host memory); name: the tier's name in
        the tiered store's counters and in `stats` (keys `<name>_hits` ...)."""
        self.budget_bytes = budget_bytes
        self.device = device
        self.name = name
        self._items: OrderedDict[str, tuple[ChunkEntry, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0

    def get(self, key: str) -> ChunkEntry | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item[0]

    def get_blocks(self, key: str, blocks: list[int]) -> tuple[ChunkEntry, int] | None:
        """The blocks sliced out of the decoded chunk: nothing is read from storage (0 bytes)."""
        entry = self.get(key)
        return None if entry is None else (slice_blocks(entry, blocks), 0)

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._items

    def size(self, key: str) -> int | None:
        with self._lock:
            item = self._items.get(key)
            return None if item is None else item[1]

    def put(self, key: str, entry: ChunkEntry) -> bool:
        """Keep `entry`; False when it alone exceeds the budget (then it is not kept)."""
        size = entry.k.nbytes + entry.v.nbytes
        if size > self.budget_bytes:
            return False
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            # evicted before the copy, so what the tier holds never passes its budget, even for a moment: a
            # device tier's budget is carved from the worker's one device KV ledger (engine/ledger.py)
            while self._bytes + size > self.budget_bytes:
                _, (_, evicted) = self._items.popitem(last=False)
                self._bytes -= evicted
                self.evictions += 1
            if self.device is not None:  # from page-locked memory the copy is asynchronous: ordered on the stream
                k, v, header = entry
                entry = ChunkEntry(k.to(self.device, non_blocking=True), v.to(self.device, non_blocking=True),
                                   header)
            self._items[key] = (entry, size)
            self._bytes += size
        return True

    def remove(self, key: str) -> bool:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
        return old is not None

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            n = self.name
            return {
                f"{n}_budget_bytes": self.budget_bytes,
                f"{n}_bytes": self._bytes,
                f"{n}_items": len(self._items),
                f"{n}_hits": self.hits,
                f"{n}_misses": self.misses,
                f"{n}_evictions": self.evictions,
            }
