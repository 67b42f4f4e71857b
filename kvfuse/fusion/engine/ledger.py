"""One device-memory ledger per worker: every KV tensor it holds on its device, against one budget.

The budget is `server.kv_budget_tokens` tokens of the model's KV (K and V of every layer) on the worker's
device. Its holders (docs/DESIGN.md, "One device-memory ledger"):
- carved from the KV memory (kv_memory.py), as extents: queries' fused caches and their n > 1 forks,
  samkv's probe (inside its query's own extent), the shadow checks' full prefills, and ingestion's
  precompute forward (an extent of its size held while the piece runs: the model's own cache lives
  beside the buffer, so this one is counted, not placed);
- counted in the KV memory by bytes (`KVMemory.hold`): the system prompts' cached KV (the prefix cache),
  reclaimed when an extent needs the room; and a query's load while it runs (`transient`): its cold
  chunks computed at first use (samkv's too, and a chunk its block reader finds gone during the
  prefill) and its system prompt's forward before it is cached, each the model's own cache beside the
  buffer (counted, not placed). A load that finds no room sends its query back to wait (`NeedsRoom`,
  Scheduler.requeue) with that room asked for at its next admission;
- carved off the budget before the buffer is allocated (`Carve`): the device tier's entries (int8 or
  another storage format, which the buffer's dtype cannot hold). The buffer is the budget less the
  carves, so what the tier holds within its own bound (its eviction is its own, kvfuse/store/hot_tier.py)
  and what the buffer holds never add up past the budget, on any device.

So a worker's device KV is never above its budget by this account. What it cannot see: any tensor still
referenced after its holder let it go (a cached system prompt reclaimed while a query's prefill still
reads it), and the forwards' activations, which are not KV.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvfuse.fusion.engine.kv_memory import KVMemory, MemoryFull

KINDS = ("query", "shadow", "ingest", "prefix", "load")  # the KV memory's holders, always reported (0 when idle)
_transients = itertools.count()


class NeedsRoom(MemoryFull):
    """A query's load needs `tokens` of transient KV (`what`) that the memory cannot count now: the engine
    core sends the query back to wait until they are free beside its extent (Scheduler.requeue)."""

    def __init__(self, tokens: int, what: str, free: int) -> None:
        super().__init__(f"{what} needs {tokens} KV tokens beside the prompt's extent; {free} are free")
        self.tokens, self.what = tokens, what


@contextmanager
def transient(ledger: Ledger | None, tokens: int, what: str) -> Iterator[None]:
    """Count `tokens` of KV that a forward keeps beside the buffer (the model's own cache) in the ledger's
    memory for the block's duration, reclaiming cached system prompts for the room, and read it into the
    peaks; NeedsRoom when it cannot be had. Without a ledger (an engine outside any core) nothing is
    counted."""
    if ledger is None or tokens <= 0:
        yield
        return
    memory, owner = ledger.memory, ("load", next(_transients))
    if not memory.hold(owner, tokens * memory.token_bytes, "load", make_room=True):
        raise NeedsRoom(tokens, what, memory.free_tokens)
    try:
        ledger.observe()
        yield
    finally:
        memory.unhold(owner)


@dataclass(frozen=True)
class Carve:
    """A holder whose bytes live outside the buffer, bounded by its own cap: `used()` reads what it holds."""

    kind: str
    cap_bytes: int
    used: Callable[[], int]


@dataclass(frozen=True)
class LedgerReport:
    """What a ledger says at one moment (sent with every engine step and on /ready)."""

    device: str
    budget_bytes: int
    used_bytes: int
    peak_bytes: int
    holders: dict[str, int]  # bytes held by each holder now
    caps: dict[str, int]  # the carves' caps (bytes set aside from the budget for them)
    peak_holders: dict[str, int]  # the most bytes each holder held at a reading since start

    def as_dict(self) -> dict[str, object]:
        return {"device": self.device, "budget_bytes": self.budget_bytes, "used_bytes": self.used_bytes,
                "peak_bytes": self.peak_bytes, "holders": dict(self.holders), "caps": dict(self.caps),
                "peak_holders": dict(self.peak_holders)}


def carved_tokens(carves: tuple[Carve, ...] | list[Carve], token_bytes: int) -> int:
    """Whole tokens of the budget the carves take (rounded up: the buffer never reaches into them)."""
    return sum(-(-c.cap_bytes // token_bytes) for c in carves)


class Ledger:
    """The ledger of one device: the KV memory's extents and holds, plus the carves beside its buffer."""

    def __init__(self, memory: KVMemory, budget_tokens: int, carves: tuple[Carve, ...] | list[Carve] = (),
                 device: str = "cpu") -> None:
        self.memory = memory
        self.carves = tuple(carves)
        self.device = device
        self.budget_bytes = budget_tokens * memory.token_bytes
        self.peak_bytes = 0
        self.step_peak = 0  # the most bytes read since the engine core's step began (it resets this)
        self.peak_holders: dict[str, int] = {}  # the most bytes each holder held at a reading since start

    def holders(self) -> dict[str, int]:
        """Bytes held now by each holder: the memory's by kind, then each carve's."""
        out = dict.fromkeys(KINDS, 0) | self.memory.bytes_by_kind()
        for c in self.carves:
            out[c.kind] = out.get(c.kind, 0) + c.used()
        return out

    def used_bytes(self) -> int:
        return sum(self.holders().values())

    def observe(self) -> tuple[int, dict[str, int]]:
        """Read what is held now into the peaks (the core reads it where its use is highest in a step):
        (bytes in all, bytes by holder)."""
        holders = self.holders()
        used = sum(holders.values())
        self.peak_bytes = max(self.peak_bytes, used)
        self.step_peak = max(self.step_peak, used)
        for kind, nbytes in holders.items():
            self.peak_holders[kind] = max(self.peak_holders.get(kind, 0), nbytes)
        return used, holders

    def report(self) -> LedgerReport:
        used, holders = self.observe()
        return LedgerReport(self.device, self.budget_bytes, used, self.peak_bytes, holders,
                            {c.kind: c.cap_bytes for c in self.carves}, dict(self.peak_holders))
