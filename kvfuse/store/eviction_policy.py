"""Which chunks a bounded tier gives up first: LRU, LFU, S3-FIFO and a cost-aware policy, one interface.

A policy is pure bookkeeping over keys and sizes (no I/O, no clock): the tier tells it what it inserted,
what was read and what went, and asks it for victims when a put would pass the tier's budget. It keeps
nothing but keys, sizes and counters, so a tier of millions of chunks holds it in memory; a tier's
reads update it without any write to storage (docs/DESIGN.md, "Bounded tiers").

- `lru`:      least recently used first.
- `lfu`:      fewest reads since insertion first, the least recent of equal counts first (in-cache LFU:
              a chunk's count is forgotten when it goes).
- `s3fifo`:   S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23): a small
              FIFO (10% of the budget, in bytes) that new chunks enter, a main FIFO with 2-bit
              reinsertion (a read adds one up to 3; a chunk at the tail with a count left goes back to
              the head with one less), and a ghost FIFO of keys only, as large in bytes as the main one.
              A chunk at the small FIFO's tail that was read since it came in moves to the main FIFO
              (the threshold of libCacheSim's reference S3FIFOv0: read once more), else it goes and its
              key enters the ghost; a chunk inserted while its key is in the ghost enters the main FIFO.
              The ghost keeps as many keys as the tier holds chunks (the paper: as many as the main
              FIFO, which holds nine in ten of them), so the Redis tier's script can bound it alike.
- `cost`:     GreedyDual-Size-Frequency (Cherkasova, 1998), the cost-aware policy: priority
              L + reads x cost / bytes, the lowest goes first, and L rises to each victim's priority
              (so chunks not read for a long time age out). `cost` is what a miss costs: the chunk's
              recompute seconds (its tokens at the measured precompute rate).

Pinned keys (a running query's chunks) are never victims; they keep their place.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Container
from typing import ClassVar

POLICIES = ("lru", "lfu", "s3fifo", "cost")
SMALL_SHARE = 0.10  # S3-FIFO's small FIFO, of the budget (the paper's 10%)
MAX_FREQ = 3  # S3-FIFO's 2-bit counter


class EvictionPolicy(ABC):
    """What a bounded tier holds, and in what order it gives it up. Not thread-safe: the tier locks."""

    name: ClassVar[str]

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.sizes: dict[str, int] = {}
        self.bytes = 0

    def __contains__(self, key: object) -> bool:
        return key in self.sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def insert(self, key: str, nbytes: int, cost: float = 0.0) -> None:
        """Track a chunk the tier just stored (again: its size and cost are updated, its place is not)."""
        if key in self.sizes:
            self.bytes += nbytes - self.sizes[key]
            self.sizes[key] = nbytes
            self._update(key, cost)
            return
        self.sizes[key] = nbytes
        self.bytes += nbytes
        self._insert(key, nbytes, cost)

    def access(self, key: str) -> bool:
        """A read of the chunk (False: the policy does not track it)."""
        if key not in self.sizes:
            return False
        self._access(key)
        return True

    def remove(self, key: str) -> bool:
        """The chunk went by other rules (its last document was deleted); False when not tracked."""
        nbytes = self.sizes.pop(key, None)
        if nbytes is None:
            return False
        self.bytes -= nbytes
        self._remove(key, nbytes)
        return True

    def victims(self, free_bytes: int, pinned: Container[str] = frozenset()) -> list[str]:
        """Take chunks out, in the policy's order, until at least `free_bytes` are freed or nothing but
        pinned chunks is left; returns their keys (the caller deletes them)."""
        out: list[str] = []
        freed = 0
        while freed < free_bytes:
            key = self._pick(pinned)
            if key is None:
                break
            nbytes = self.sizes.pop(key)
            freed += nbytes
            self.bytes -= nbytes
            out.append(key)
        return out

    # --- what each policy defines
    @abstractmethod
    def _insert(self, key: str, nbytes: int, cost: float) -> None: ...

    def _update(self, key: str, cost: float) -> None:  # noqa: B027 - only the cost-aware policy keeps a cost
        pass

    @abstractmethod
    def _access(self, key: str) -> None: ...

    @abstractmethod
    def _remove(self, key: str, nbytes: int) -> None: ...

    @abstractmethod
    def _pick(self, pinned: Container[str]) -> str | None:
        """The next victim, taken out of the policy's own structures (None: none but pinned ones left)."""


class LRU(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._order: OrderedDict[str, None] = OrderedDict()

    def _insert(self, key: str, nbytes: int, cost: float) -> None:
        self._order[key] = None

    def _access(self, key: str) -> None:
        self._order.move_to_end(key)

    def _remove(self, key: str, nbytes: int) -> None:
        del self._order[key]

    def _pick(self, pinned: Container[str]) -> str | None:
        for key in self._order:
            if key not in pinned:
                del self._order[key]
                return key
        return None


Score = tuple[float, ...]  # a heap key: the entry with the smallest score is evicted first

class _ScoreHeap(EvictionPolicy):
    """A min-heap of scores with lazy deletion: an entry is live while its score is the key's current one."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._score: dict[str, Score] = {}
        self._heap: list[tuple[Score, str]] = []

    def _set(self, key: str, score: Score) -> None:
        self._score[key] = score
        heapq.heappush(self._heap, (score, key))

    def _remove(self, key: str, nbytes: int) -> None:
        del self._score[key]

    def _pick(self, pinned: Container[str]) -> str | None:
        skipped = []
        found = None
        while self._heap:
            score, key = heapq.heappop(self._heap)
            if self._score.get(key) != score:
                continue  # stale
            if key in pinned:
                skipped.append((score, key))
                continue
            found = key
            break
        for item in skipped:
            heapq.heappush(self._heap, item)
        if found is not None:
            self._taken(found, self._score.pop(found))
        if len(self._heap) > 4 * len(self._score) + 64:  # drop stale entries now and then
            self._heap = [(s, k) for k, s in self._score.items()]
            heapq.heapify(self._heap)
        return found

    def _taken(self, key: str, score: Score) -> None:  # noqa: B027 - the cost-aware policy ages on it
        pass


class LFU(_ScoreHeap):
    name = "lfu"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._tick = 0
        self._reads: dict[str, int] = {}

    def _touch(self, key: str) -> None:
        self._tick += 1
        self._set(key, (self._reads[key], self._tick))

    def _insert(self, key: str, nbytes: int, cost: float) -> None:
        self._reads[key] = 0
        self._touch(key)

    def _access(self, key: str) -> None:
        self._reads[key] += 1
        self._touch(key)

    def _remove(self, key: str, nbytes: int) -> None:
        super()._remove(key, nbytes)
        del self._reads[key]

    def _taken(self, key: str, score: Score) -> None:
        del self._reads[key]


class CostAware(_ScoreHeap):
    """GreedyDual-Size-Frequency over recompute cost (see the module docstring)."""

    name = "cost"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.clock = 0.0  # L: the priority of the last victim
        self._reads: dict[str, int] = {}
        self._cost: dict[str, float] = {}
        self._tick = 0

    def priority(self, key: str) -> float:
        return self.clock + self._reads[key] * self._cost[key] / max(self.sizes[key], 1)

    def _rescore(self, key: str) -> None:
        self._tick += 1  # ties: the least recent first
        self._set(key, (self.priority(key), self._tick))

    def _insert(self, key: str, nbytes: int, cost: float) -> None:
        self._reads[key], self._cost[key] = 1, cost
        self._rescore(key)

    def _update(self, key: str, cost: float) -> None:
        self._cost[key] = cost

    def _access(self, key: str) -> None:
        self._reads[key] += 1
        self._rescore(key)

    def _remove(self, key: str, nbytes: int) -> None:
        super()._remove(key, nbytes)
        del self._reads[key], self._cost[key]

    def _taken(self, key: str, score: Score) -> None:
        self.clock = max(self.clock, score[0])
        del self._reads[key], self._cost[key]


class S3FIFO(EvictionPolicy):
    name = "s3fifo"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.small: OrderedDict[str, None] = OrderedDict()  # head = last (newest), tail = first
        self.main: OrderedDict[str, None] = OrderedDict()
        self.ghost: OrderedDict[str, None] = OrderedDict()  # keys only
        self.freq: dict[str, int] = {}
        self.small_bytes = self.main_bytes = 0

    def _insert(self, key: str, nbytes: int, cost: float) -> None:
        self.freq[key] = 0
        if key in self.ghost:
            del self.ghost[key]
            self.main[key] = None
            self.main_bytes += nbytes
        else:
            self.small[key] = None
            self.small_bytes += nbytes

    def _access(self, key: str) -> None:
        self.freq[key] = min(self.freq[key] + 1, MAX_FREQ)

    def _remove(self, key: str, nbytes: int) -> None:
        del self.freq[key]
        if key in self.small:
            del self.small[key]
            self.small_bytes -= nbytes
        else:
            del self.main[key]
            self.main_bytes -= nbytes

    def _to_ghost(self, key: str) -> None:
        self.ghost[key] = None
        while len(self.ghost) > len(self.small) + len(self.main):
            self.ghost.popitem(last=False)

    def _pick(self, pinned: Container[str]) -> str | None:
        # A pinned chunk goes back to its queue's head untouched; a queue whose every chunk was seen
        # pinned is passed over. Each main chunk loses a count per pass, so the loop ends.
        pinned_small: set[str] = set()
        pinned_main: set[str] = set()
        while True:
            small_open = len(pinned_small) < len(self.small)
            main_open = len(pinned_main) < len(self.main)
            if not small_open and not main_open:
                return None
            if small_open and (self.small_bytes >= self.capacity_bytes * SMALL_SHARE or not main_open):
                key = self._small_tail(pinned, pinned_small)
            else:
                key = self._main_tail(pinned, pinned_main)
            if key is not None:
                return key

    def _small_tail(self, pinned: Container[str], pinned_seen: set[str]) -> str | None:
        key = next(iter(self.small))
        nbytes = self.sizes[key]
        if key in pinned:
            pinned_seen.add(key)
            self.small.move_to_end(key)
            return None
        del self.small[key]
        self.small_bytes -= nbytes
        if self.freq[key] >= 1:  # read since it came in: into the main FIFO, its count cleared
            self.freq[key] = 0
            self.main[key] = None
            self.main_bytes += nbytes
            return None
        del self.freq[key]
        self._to_ghost(key)
        return key

    def _main_tail(self, pinned: Container[str], pinned_seen: set[str]) -> str | None:
        key = next(iter(self.main))
        self.main.move_to_end(key)  # reinserted at the head, unless it goes
        if key in pinned:
            pinned_seen.add(key)
            return None
        if self.freq[key] > 0:
            self.freq[key] -= 1
            return None
        del self.main[key]
        self.main_bytes -= self.sizes[key]
        del self.freq[key]
        return key


def make_policy(name: str, capacity_bytes: int) -> EvictionPolicy:
    """The policy named `name` (one of POLICIES) for a tier of `capacity_bytes`."""
    classes: dict[str, type[EvictionPolicy]] = {c.name: c for c in (LRU, LFU, S3FIFO, CostAware)}
    if name not in classes:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {POLICIES}")
    return classes[name](capacity_bytes)
