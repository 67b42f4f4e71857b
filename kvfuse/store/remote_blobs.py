"""The blob tier of an API process that keeps no chunk KV: a fleet's API (`kvfuse serve --workers 0`).

In a fleet the chunk blobs live on the worker hosts (their LMDB) and in the shared Redis tier
(shared_tier.py); the API's store keeps the document catalog only. The catalog still asks its blob tier
whether a chunk is stored (a `ready` document must refer only to stored chunks) and drops a blob when the
last document using it goes. Here a chunk counts as stored because a worker reported it stored (the
precompute job's Done names its keys), and dropping a chunk removes its shared copy; a worker's LMDB
copy stays as that host's cache (content-addressed, so never wrong). See docs/DESIGN.md, "Scale-out".
"""

from __future__ import annotations

import lmdb

from kvfuse.store.chunk_store import ChunkStore
from kvfuse.store.lmdb_budget import LmdbBudget
from kvfuse.store.lmdb_env import LmdbEnv
from kvfuse.store.lmdb_tier import LmdbTier


class RemoteBlobs(LmdbTier):
    name = "remote"

    def __init__(self, env: LmdbEnv, *, verify: bool = True, pin: bool = False, budget: LmdbBudget | None = None,
                 shared: ChunkStore | None = None) -> None:
        super().__init__(env, verify=verify, pin=pin, budget=budget)
        self.shared = shared

    def stored(self, txn: lmdb.Transaction, key: str) -> bool:
        return True

    def drop(self, txn: lmdb.Transaction, key: str) -> bool:
        if self.shared is not None:
            self.shared.remove(key)
        return super().drop(txn, key) or True
