"""What the object store holds of a document's chunks, asked before the catalog's write transaction
(catalog.DocumentCatalog: a document may be `ready` with chunks only the object store holds,
records.unheld_chunks). A HEAD is a network round trip; LMDB has one writer, so a HEAD inside its write
transaction would hold every other write behind it (docs/DESIGN.md, "Bounded tiers")."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import lmdb

from kvfuse.store.errors import StoreError
from kvfuse.store.lmdb_env import LmdbEnv

T = TypeVar("T")


class NotAsked(Exception):
    """A write found chunks LMDB does not hold that the object store was not asked about before the
    transaction began (the record changed in between): they are asked after it aborts, then it runs again."""

    def __init__(self, keys: list[str]) -> None:
        super().__init__(f"{len(keys)} chunks not asked of the object store")
        self.keys = keys


class ObjectHolds:
    """The object store's answers for a document's chunks LMDB does not hold, asked before the write
    transaction: a HEAD is a network round trip, never made while LMDB's one writer is held (every other
    write would wait on it). A chunk stored or evicted meanwhile is held by LMDB inside the transaction;
    one the object store deleted meanwhile is caught by `store check`, as one deleted just after the
    write would be (docs/DESIGN.md, "Bounded tiers")."""

    def __init__(self, contains: Callable[[str], bool]) -> None:
        self._contains = contains
        self.held: dict[str, bool] = {}

    def ask(self, keys: Iterable[str]) -> None:
        for k in keys:
            if k not in self.held:
                self.held[k] = self._contains(k)

    def require(self, keys: Iterable[str]) -> None:
        """Inside the transaction: raise NotAsked for any of `keys` not asked before it."""
        unasked = [k for k in keys if k not in self.held]
        if unasked:
            raise NotAsked(unasked)

    def __call__(self, key: str) -> bool:
        return self.held[key]


def write_after_asking(env: LmdbEnv, holds: ObjectHolds, fn: Callable[[lmdb.Transaction, ObjectHolds], T],
                       unknown: Callable[[lmdb.Transaction], list[str]]) -> T:
    """Ask the object store about the chunks `unknown` lists in a read transaction (those LMDB does not
    hold), then run `fn` in one write transaction; `fn` raises NotAsked (holds.require) for any chunk the
    record gained in between, which is asked before `fn` runs again."""
    with env.read() as txn:
        keys = unknown(txn)
    holds.ask(keys)
    for _ in range(3):
        try:
            return env.write(lambda txn: fn(txn, holds))
        except NotAsked as err:
            holds.ask(err.keys)
    raise StoreError("the document kept changing while the object store was asked about its chunks; retry")
