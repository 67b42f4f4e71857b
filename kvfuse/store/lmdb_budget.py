"""The byte budget of a host's LMDB blob tier (`store.lmdb_budget_mb`): what it holds, in what order it
gives chunks up, and which chunks a running query holds (docs/DESIGN.md, "Bounded tiers").

The process that writes blobs evicts: a put that would take the stored chunk KV past the budget evicts,
in the same write transaction, the policy's victims (store/eviction_policy.py) until it fits, so LMDB
never holds more than the budget plus the blob being written. The policy lives in this process's memory
and reads update it there: no LMDB write per read. It is seeded at open from the stored chunks, oldest
first (so after a restart the order starts from ingestion order, not from the reads before it). A blob
another process stored is unknown to the policy: when the policy has no victim left, blobs go in key
order (content hashes: at random).

Pins: the chunks of a query being loaded are pinned (`pinned`), and never chosen as victims until it
has read them. A read copies the blob out of LMDB's map inside its read transaction (lmdb_tier.py), so
an eviction can never free bytes a reader is using: a pin only keeps a chunk the query planned to read
from being rebuilt instead.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Container, Iterable, Iterator, Sequence
from contextlib import contextmanager

from kvfuse.store.eviction_policy import EvictionPolicy, make_policy
from kvfuse.store.records import ChunkInfo


class _Either:
    """Membership in either of two containers (the pins and the caller's kept chunks), without a copy."""

    def __init__(self, a: Container[str], b: Container[str]) -> None:
        self.a, self.b = a, b

    def __contains__(self, key: object) -> bool:
        return key in self.a or key in self.b


class LmdbBudget:
    """Policy, pins and counters of one process's view of a bounded LMDB tier (thread-safe)."""

    def __init__(self, budget_bytes: int, policy: str) -> None:
        self.budget_bytes = budget_bytes
        self.policy: EvictionPolicy = make_policy(policy, budget_bytes)
        self._lock = threading.Lock()
        self._pins: Counter[str] = Counter()
        self.evictions = 0
        self.evicted_bytes = 0

    def seed(self, infos: Iterable[ChunkInfo]) -> None:
        """Track the chunks already stored, oldest first."""
        with self._lock:
            for info in sorted(infos, key=lambda i: i.created_at):
                self.policy.insert(info.key, info.bytes, float(info.tokens))

    def stored(self, key: str, nbytes: int, tokens: int) -> None:
        """A blob was written. Its cost is its tokens: the recompute seconds at the precompute rate, a
        factor the same for every chunk, which does not change the cost-aware policy's order."""
        with self._lock:
            self.policy.insert(key, nbytes, float(tokens))

    def accessed(self, key: str) -> None:
        with self._lock:
            self.policy.access(key)

    def removed(self, key: str) -> None:
        with self._lock:
            self.policy.remove(key)

    def victims(self, free_bytes: int, kept: Container[str] = frozenset()) -> list[str]:
        """The policy's victims for `free_bytes`, pinned chunks and `kept` skipped; they are out of the
        policy now."""
        with self._lock:
            return self.policy.victims(free_bytes, _Either(self._pins, kept))

    def is_pinned(self, key: str) -> bool:
        with self._lock:
            return self._pins[key] > 0

    def counted(self, nbytes: int) -> None:
        with self._lock:
            self.evictions += 1
            self.evicted_bytes += nbytes

    @contextmanager
    def pinned(self, keys: Sequence[str]) -> Iterator[None]:
        """Keep these chunks from being evicted while the block runs (a query loading them)."""
        with self._lock:
            self._pins.update(keys)
        try:
            yield
        finally:
            with self._lock:
                self._pins.subtract(keys)
                for k in keys:
                    if self._pins[k] <= 0:
                        del self._pins[k]

    def stats(self) -> dict[str, int | str]:
        with self._lock:
            return {"lmdb_budget_bytes": self.budget_bytes, "lmdb_evictions": self.evictions,
                    "lmdb_evicted_bytes": self.evicted_bytes, "lmdb_policy": self.policy.name}
