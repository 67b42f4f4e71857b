"""One device-memory ledger per worker: every KV tensor it holds on its device, against one budget.

The budget is `server.kv_budget_tokens` tokens of the model's KV (K and V of every layer) on the worker's
device. Its holders (docs/DESIGN.md, "One device-memory ledger"):
- carved from the KV memory (kv_memory.py), as extents: queries' fused caches and their n > 1 forks,
  samkv's probe (inside its query's own extent), the shadow checks' full prefills, and ingestion's
  precompute forward (an extent of its size held while the piece runs: the model's own cache lives
  beside the buffer, so this one is counted, not placed);
- counted in the KV memory by bytes (`KVMemory.hold`): the system prompts' cached KV (the prefix cache),
  reclaimed when an extent needs the room;
- carved off the budget before the buffer is allocated (`Carve`): the device tier's entries (int8 or
  another storage format, which the buffer's dtype cannot hold). The buffer is the budget less the
  carves, so what the tier holds within its own bound (its eviction is its own, kvfuse/store/hot_tier.py)
  and what the buffer holds never add up past the budget, on any device.

So a worker's device KV is never above its budget by this account. What it cannot see: a query's cold
chunks computed at first use and a system prompt's forward before it is cached (the model's cache of
that forward, freed when it returns), and any tensor still referenced after its holder let it go.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvfuse.fusion.engine.kv_memory import KVMemory

KINDS = ("query", "shadow", "ingest", "prefix")  # the KV memory's holders, always reported (0 when idle)


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
        for kind, nbytes in holders.items():
            self.peak_holders[kind] = max(self.peak_holders.get(kind, 0), nbytes)
        return used, holders

    def report(self) -> LedgerReport:
        used, holders = self.observe()
        return LedgerReport(self.device, self.budget_bytes, used, self.peak_bytes, holders,
                            {c.kind: c.cap_bytes for c in self.carves}, dict(self.peak_holders))
