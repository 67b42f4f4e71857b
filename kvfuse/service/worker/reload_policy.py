"""Reload or recompute: for each chunk of a query, whether its stored KV is read from the tier it is in or
computed again from its tokens, whichever the measurements say is faster (docs/DESIGN.md, "Storage").

Reading a chunk costs its stored bytes over the bandwidth its tier has shown; recomputing it costs its
tokens over the engine's precompute throughput. When a tier is slow enough (a shared tier across a
loaded network, a cold disk) against a fast engine, reading loses and reuse does not pay at all: the
finding that makes the bytes per token of a format matter (docs/results/kv-formats/README.md).

Both rates are measured, never configured: once when the worker starts (a read from each storage tier
that holds something, a short precompute) and then from every read and precompute the worker does,
each folded into an exponentially weighted moving average (`store.reload_ewma_weight`). A rate not
measured yet decides nothing: the chunk is read. The reads of one query from one tier are taken to share
its bandwidth (the estimate adds their bytes), which is what a network link or a disk does.

This module is pure arithmetic over what it is told; the worker's ChunkCache (chunk_kv.py) probes the
tiers, times the reads and precomputes, and acts on the plan.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

READ, RECOMPUTE = "read", "recompute"
# Why a chunk was read or recomputed (the `reason` label of kvfuse_kv_chunk_sources_total):
FASTER = "read_faster"  # its tier reads it faster than the engine computes it
UNMEASURED = "unmeasured"  # a rate is not known yet: read (what the worker did before measuring)
SLOWER = "read_slower"  # its tier would take longer than computing it again
MISS = "miss"  # in no tier: computed from its tokens (as always)


class Ewma:
    """An exponentially weighted moving average; None until the first sample."""

    def __init__(self, weight: float) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"an EWMA weight is in (0, 1], not {weight}")
        self.weight = weight
        self.value: float | None = None
        self.samples = 0

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.weight * (x - self.value)
        self.samples += 1


class Rates:
    """What the worker has measured: bytes per second read from each tier, tokens per second
    precomputed. Thread-safe: reads are observed on the store's read threads."""

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.read_bps: dict[str, Ewma] = {}
        self.precompute_tps = Ewma(weight)
        self._lock = threading.Lock()

    def observe_read(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self.read_bps.setdefault(tier, Ewma(self.weight)).add(nbytes / seconds)

    def observe_precompute(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        with self._lock:
            self.precompute_tps.add(tokens / seconds)

    def read_rate(self, tier: str) -> float | None:
        with self._lock:
            e = self.read_bps.get(tier)
            return None if e is None else e.value

    def snapshot(self) -> dict[str, float | None]:
        """The rates as numbers (what `kvfuse bench` and the logs show)."""
        with self._lock:
            out: dict[str, float | None] = {f"read_bps_{t}": e.value for t, e in self.read_bps.items()}
            return out | {"precompute_tokens_per_s": self.precompute_tps.value}


@dataclass(frozen=True)
class Choice:
    """One chunk's decision: `decision` READ or RECOMPUTE, `reason` one of the reasons above, and the
    estimates it was made from (None where a rate was not known)."""

    decision: str
    reason: str
    read_s: float | None = None
    recompute_s: float | None = None


@dataclass(frozen=True)
class Chunk:
    """What the policy needs to know of a chunk: the tier it is in (None: in none), its stored bytes
    and its tokens."""

    tier: str | None
    nbytes: int
    tokens: int


def plan(chunks: Sequence[Chunk], rates: Rates) -> list[Choice]:
    """Each chunk read or recomputed, in order. The reads of one query from one tier share its bandwidth,
    so a tier's chunks go together: read when their bytes over its bandwidth take no longer than their
    tokens over the precompute throughput, else recomputed. Each choice keeps its own chunk's estimates."""
    tps = rates.precompute_tps.value
    tier_bytes = Counter()
    for c in chunks:
        if c.tier is not None:
            tier_bytes[c.tier] += c.nbytes
    out = []
    for c in chunks:
        if c.tier is None:
            out.append(Choice(RECOMPUTE, MISS))
            continue
        bps = rates.read_rate(c.tier)
        if bps is None or tps is None:
            out.append(Choice(READ, UNMEASURED))
            continue
        read_s, recompute_s = c.nbytes / bps, c.tokens / tps
        if tier_bytes[c.tier] / bps > sum(x.tokens for x in chunks if x.tier == c.tier) / tps:
            out.append(Choice(RECOMPUTE, SLOWER, read_s, recompute_s))
        else:
            out.append(Choice(READ, FASTER, read_s, recompute_s))
    return out


def counts(choices: Sequence[Choice]) -> dict[str, int]:
    """{"<decision>:<reason>": chunks} of a plan (the worker reports them; the API counts them)."""
    return dict(Counter(f"{c.decision}:{c.reason}" for c in choices))
