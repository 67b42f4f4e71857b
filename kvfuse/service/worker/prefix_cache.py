"""The system prompts' KV, kept decoded on the model's device: one query's system prompt is every query's
that shares it, so its prefill is computed once and cached by content, like any chunk (ChunkCache.key_of
of its tokens, alone).

Each entry is held in the worker's one device ledger (kvfuse/fusion/engine/ledger.py) by bytes, a
reclaimable hold: the memory drops it, least recently used first, when an extent needs its room. A new
entry's forward is counted beside it while it runs; without the room for both, the query waits for it
(NeedsRoom: the engine core sends it back to the queue). docs/DESIGN.md, "One device-memory ledger".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kvfuse.fusion.engine.ledger import Ledger, NeedsRoom, transient

ENTRIES = 8  # distinct system prompts kept


class PrefixCache:
    """System prompts' ChunkKVs by content key, `ENTRIES` at most, least recently used dropped first."""

    def __init__(self, engine: Any, key_of: Callable[[list[int]], str]) -> None:
        self.engine = engine
        self.key_of = key_of
        self._entries: OrderedDict[str, Any] = OrderedDict()
        self._ledger: Ledger | None = None  # the engine core's (`hold_in`); None: nothing counted

    def hold_in(self, ledger: Ledger) -> None:
        """Hold every entry, and count every new entry's forward, in `ledger` from now on."""
        self._ledger = ledger

    def nbytes(self) -> int:
        """Bytes of K and V the entries hold (what their holds in the ledger count)."""
        return sum(int(c.k.nbytes + c.v.nbytes) for c in self._entries.values())

    def get(self, prefix_ids: list[int]) -> Any:
        """The system prompt's KV: cached, or computed now and kept."""
        key = self.key_of(prefix_ids)
        memory = self._ledger.memory if self._ledger is not None else None
        if key in self._entries:
            self._entries.move_to_end(key)
            if memory is not None:
                memory.touch(("prefix", key))
            return self._entries[key]
        ckv = self._computed(key, prefix_ids)
        self._entries[key] = ckv
        while len(self._entries) > ENTRIES:
            old, _ = self._entries.popitem(last=False)
            if memory is not None:
                memory.unhold(("prefix", old))
        return ckv

    def _computed(self, key: str, prefix_ids: list[int]) -> Any:
        """A system prompt's KV computed: its forward's cache counted while it runs (`transient`) and, beside
        it, the entry's copy held from before the forward on (a reclaimable hold: a later extent may take
        its room; the transient's own reclaiming cannot, being already held). Without the room for both,
        NeedsRoom for twice the prompt's tokens."""
        ledger = self._ledger
        if ledger is None:
            return self.engine.precompute([prefix_ids])[0]
        memory, owner, n = ledger.memory, ("prefix", key), len(prefix_ids)
        try:
            with transient(ledger, n, "the system prompt's forward"):
                if not memory.hold(owner, n * memory.token_bytes, "prefix", make_room=True,
                                   reclaim=lambda: self._entries.pop(key, None)):
                    raise NeedsRoom(n, "the system prompt's KV", memory.free_tokens)
                ledger.observe()  # the forward's cache and the entry, both held
                return self.engine.precompute([prefix_ids])[0]
        except NeedsRoom:
            memory.unhold(owner)
            raise NeedsRoom(2 * n, "the system prompt's KV and its forward", memory.free_tokens) from None
        except BaseException:
            memory.unhold(owner)
            raise
