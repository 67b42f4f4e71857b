"""The catalog's index mirror (a Redis copy of the LMDB records) kept in step with LMDB.

The catalog (catalog.py) writes LMDB first and the mirror after. When a mirror call fails (Redis down)
the mirror is marked lost, and stale too if the failed call was a write; at its next use it is pinged
and, if stale or no longer holding this store's marker (a Redis that restarted empty or was flushed),
rebuilt from LMDB. Writes hold one lock, so a rebuild never runs between another thread's LMDB write and
its mirror write. The flags live in this process only: a process that dies with a stale mirror leaves
the marker in place, which is why `kvfuse store convert` invalidates the marker itself (convert.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

from kvfuse.store.errors import IndexUnavailableError
from kvfuse.store.index import IndexMirror

log = logging.getLogger("kvfuse.store.catalog")


class MirrorSync:
    """One catalog's mirror and what is known of its state. `rebuild()` replaces the mirror with the
    LMDB records (the catalog's `rebuild_index`); `readonly`: this process may not rebuild it."""

    def __init__(self, mirror: IndexMirror, rebuild: Callable[[], object], *, readonly: bool,
                 rebuild_on_empty: bool) -> None:
        self.mirror = mirror
        self._rebuild = rebuild
        self._readonly = readonly
        self._rebuild_on_empty = rebuild_on_empty
        self.store_id = ""  # set by the catalog once it knows which LMDB store it is
        self.lost = False  # a call failed: re-check the mirror when it answers again
        self.stale = False  # a mirror write failed: rebuild when it answers again
        self.lock = threading.RLock()

    @contextmanager
    def use(self, *, write: bool = True) -> Iterator[IndexMirror]:
        """The mirror, re-checked first if it failed before; a write holds the lock."""
        with self.lock if write else nullcontext():
            try:
                if self.lost:
                    self.sync()
                    self.lost = False
                yield self.mirror
            except IndexUnavailableError:
                self.lost = True
                self.stale = self.stale or write  # the LMDB write is done; its mirror is not
                raise

    def available(self) -> bool:
        """Whether reads can be answered now (a mirror that failed is re-checked, and rebuilt if it came
        back empty)."""
        try:
            with self.use(write=False) as m:
                m.ping()
            self.resync_if_lost()
            return True
        except IndexUnavailableError:
            return False

    def resync_if_lost(self) -> bool:
        """Re-sync the mirror if it no longer holds this store's marker: a Redis that restarted empty (or
        was flushed) while no call of this process failed, so nothing else would notice. True if so.
        Checked on a miss, a listing and a readiness probe, where a lost mirror would answer wrong (a
        read: Redis down here marks nothing stale; the rebuild takes the lock itself)."""
        with self.use(write=False) as m:
            if not m.needs_rebuild(self.store_id):
                return False
            log.warning("the %s index no longer mirrors this store (restarted empty?)", self.mirror.kind)
            self.sync()
            return True

    def sync(self) -> None:
        """Ping the mirror and rebuild it if it is stale or does not mirror this store."""
        self.mirror.ping()
        if self.stale or self.mirror.needs_rebuild(self.store_id):
            kind = self.mirror.kind
            if self._readonly:
                log.warning("the %s index does not mirror this store; run `kvfuse store rebuild-index`", kind)
            elif self.stale or self._rebuild_on_empty:
                log.info("rebuilding the %s index from LMDB", kind)
                self._rebuild()
            else:
                log.warning("the %s index is empty; rebuild_index_on_empty is off", kind)
        self.stale = False
