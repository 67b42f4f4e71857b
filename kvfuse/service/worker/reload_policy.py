"""Reload or recompute: for each chunk of a query, whether its stored KV is read from the tier it is in or
computed again from its tokens, whichever the measurements say is faster (docs/DESIGN.md, "Storage").

Reading a chunk costs its tier's per-request latency plus its bytes as stored (in the KV format its blob
was written in, which need not be today's `store.kv_dtype`) over the bandwidth its tier has shown: an
object store answers each GET after tens of milliseconds whatever its size, a disk after microseconds.
Recomputing it costs its tokens (its own and its recorded context's: kvfuse/service/worker/chunk_kv.py
computes it after that context) over the engine's precompute throughput. When a tier is slow enough (a shared tier across a
loaded network, a cold disk) against a fast engine, reading loses and reuse does not pay at all: the
finding that makes the bytes per token of a format matter (docs/results/kv-formats/README.md).

Both rates are measured, never configured: once when the worker starts (a read from each storage tier
that holds something, a short precompute) and then from every read and precompute the worker does,
each folded into an exponentially weighted moving average (`store.reload_ewma_weight`). A rate not
measured yet decides nothing: the chunk is read. The reads of one query from one tier are taken to share
its bandwidth (the estimate adds their bytes), which is what a network link or a disk does, and to overlap
their latencies `store.read_threads` ways. A tier judged slower is not read, so nothing would measure it
again: every `store.reload_probe_every` plans that judge it so, one reads it anyway (`probe`), and a tier
that recovered is read again.

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
PROBE = "probe"  # judged slower, read anyway now and then to measure its tier again (Rates.probe_due)
DEFERRED = "deferred"  # in no tier, the query answered by a full prefill: computed after it (full_prefill_first)


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


class ReadModel:
    """A tier's reads as time = latency + bytes / bandwidth: a weighted least-squares line through its
    (bytes, seconds) samples, each moment an EWMA so the line follows the tier as it changes. Reads of
    one size alone cannot separate the two (the line's slope is then undefined): the model is then the
    rate of those reads, with no latency, which is exact for reads of that size."""

    def __init__(self, weight: float) -> None:
        self.n, self.x, self.y, self.xx, self.xy = Ewma(weight), Ewma(weight), Ewma(weight), Ewma(weight), Ewma(weight)

    def add(self, nbytes: int, seconds: float) -> None:
        x = nbytes / 1e6  # MB, so the moments stay well scaled
        for e, val in ((self.x, x), (self.y, seconds), (self.xx, x * x), (self.xy, x * seconds)):
            e.add(val)
        self.n.add(1.0)

    @property
    def samples(self) -> int:
        return self.n.samples

    def line(self) -> tuple[float, float] | None:
        """(latency s, bandwidth bytes/s), None before any sample."""
        if self.x.value is None:
            return None
        x, y, xx, xy = self.x.value, self.y.value, self.xx.value, self.xy.value
        var = xx - x * x
        if var > 1e-9 * max(xx, 1e-12):
            slope = (xy - x * y) / var  # seconds per MB
            latency = y - slope * x
            if slope > 0 and latency >= 0:
                return latency, 1e6 / slope
            if slope > 0:  # a line through negative latency: no latency, the slope through the origin
                return 0.0, 1e6 * xx / xy if xy > 0 else float("inf")
        return 0.0, (1e6 * x / y) if y > 0 else float("inf")

    def seconds(self, nbytes: int, requests: int) -> float | None:
        """The modelled time of `requests` reads of `nbytes` in all, None before any sample."""
        line = self.line()
        return None if line is None else requests * line[0] + nbytes / line[1]


class Rates:
    """What the worker has measured: each tier's reads (latency and bandwidth, ReadModel), tokens per
    second precomputed, and how many plans in a row judged each tier slower (a tier is probed again,
    read though judged slower, every `probe_every` such plans: else it would never be read again and its
    rate never follow the tier back when it recovers; 0 = never). Thread-safe: reads are observed on the
    store's read threads."""

    def __init__(self, weight: float, probe_every: int = 0) -> None:
        self.weight = weight
        self.probe_every = probe_every
        self.reads: dict[str, ReadModel] = {}
        self.precompute_tps = Ewma(weight)
        self.judged_slower: Counter[str] = Counter()
        self._lock = threading.Lock()

    def observe_read(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self.reads.setdefault(tier, ReadModel(self.weight)).add(nbytes, seconds)

    def observe_precompute(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        with self._lock:
            self.precompute_tps.add(tokens / seconds)

    def read_seconds(self, tier: str, nbytes: int, requests: int = 1) -> float | None:
        with self._lock:
            m = self.reads.get(tier)
            return None if m is None else m.seconds(nbytes, requests)

    def read_rate(self, tier: str) -> float | None:
        """The tier's modelled bandwidth in bytes/s (None: not measured)."""
        with self._lock:
            m = self.reads.get(tier)
            line = None if m is None else m.line()
            return None if line is None else line[1]

    def probe_due(self, tier: str) -> bool:
        """Count one more plan that judged `tier` slower; True (and the count starts again) when this one
        should read it anyway, to measure it again."""
        with self._lock:
            self.judged_slower[tier] += 1
            if self.probe_every and self.judged_slower[tier] >= self.probe_every:
                self.judged_slower[tier] = 0
                return True
            return False

    def snapshot(self) -> dict[str, float | None]:
        """The rates as numbers (what `kvfuse bench` and the logs show)."""
        with self._lock:
            out: dict[str, float | None] = {}
            for t, m in self.reads.items():
                line = m.line()
                out[f"read_bps_{t}"] = None if line is None else line[1]
                out[f"read_latency_s_{t}"] = None if line is None else line[0]
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


def plan(chunks: Sequence[Chunk], rates: Rates, parallel: int = 1) -> list[Choice]:
    """Each chunk read or recomputed, in order. The reads of one query from one tier share its bandwidth
    and are issued `parallel` at a time (so their latencies overlap that many ways), so a tier's chunks go
    together: read when latency x ceil(reads / parallel) + their bytes over its bandwidth take no longer
    than their tokens over the precompute throughput, else recomputed, except now and then (a probe:
    Rates.probe_due), when they are read to measure the tier again. Each choice keeps its own chunk's
    estimates."""
    tps = rates.precompute_tps.value
    tiers: dict[str, list[Chunk]] = {}
    for c in chunks:
        if c.tier is not None:
            tiers.setdefault(c.tier, []).append(c)
    verdict: dict[str, str] = {}
    for tier, mine in tiers.items():
        read_s = rates.read_seconds(tier, sum(c.nbytes for c in mine), -(-len(mine) // max(1, parallel)))
        if read_s is None or tps is None:
            verdict[tier] = UNMEASURED
        elif read_s <= sum(c.tokens for c in mine) / tps:
            verdict[tier] = FASTER
        else:
            verdict[tier] = PROBE if rates.probe_due(tier) else SLOWER
    out = []
    for c in chunks:
        if c.tier is None:
            out.append(Choice(RECOMPUTE, MISS))
            continue
        why = verdict[c.tier]
        read_s = rates.read_seconds(c.tier, c.nbytes)
        recompute_s = None if tps is None else c.tokens / tps
        out.append(Choice(RECOMPUTE if why == SLOWER else READ, why, read_s, recompute_s))
    return out


def counts(choices: Sequence[Choice]) -> dict[str, int]:
    """{"<decision>:<reason>": chunks} of a plan (the worker reports them; the API counts them)."""
    return dict(Counter(f"{c.decision}:{c.reason}" for c in choices))


def full_prefill_first(mode: str, cold_tokens: int, fused_tokens: int, prompt_tokens: int) -> bool:
    """Whether a query whose cold chunks (in no tier) cost `cold_tokens` to compute (their tokens and their
    recorded contexts', chunk_kv.py) is answered by a full prefill of its `prompt_tokens` instead of the
    fused prefill of `fused_tokens` (its method's recomputed rows and question) after computing them
    (`fusion.cold_chunks`: compute, full_prefill, or auto). Tokens stand for time: a chunk's precompute
    and a full prefill are the same causal forward.

    The cold chunks are computed either way (by the full-prefill path after the answer, at ingestion's
    share, and written back as the fused path writes them), so the full prefill saves the query
    cold + fused - prompt tokens of time to its first token and adds prompt - fused tokens of engine work
    that other requests wait for. auto takes it when what it saves exceeds what it adds: with a recorded
    document context as long as a chunk or longer, an all-cold query saves several times the work; with
    chunks cached alone it never does (cold <= prompt). The full prefill is vanilla's answer, the one fusion
    approximates (docs/DESIGN.md, "KV when it pays")."""
    if mode == "compute" or cold_tokens == 0:
        return False
    saved, added = cold_tokens + fused_tokens - prompt_tokens, prompt_tokens - fused_tokens
    return mode == "full_prefill" or saved > added
