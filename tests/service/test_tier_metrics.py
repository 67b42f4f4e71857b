"""The per-tier eviction counter (kvfuse_kv_tier_evictions_total) is fed running totals by workers: it
counts each total's rise once, per worker, and a worker that restarted counts from zero again."""

from __future__ import annotations

from kvfuse.service.metrics import Metrics


def _sample(m: Metrics, tier: str) -> float:
    return m.registry.get_sample_value("kvfuse_kv_tier_evictions_total", {"tier": tier}) or 0.0


def test_eviction_totals_count_once_per_rise_and_survive_a_restart() -> None:
    m = Metrics()
    m.tier_evictions("w1", "lmdb", 3)
    m.tier_evictions("w1", "lmdb", 3)  # the same total again: nothing new
    m.tier_evictions("w2", "lmdb", 2)  # another worker's own total
    m.tier_evictions("w1", "lmdb", 5)
    assert _sample(m, "lmdb") == 7
    m.tier_evictions("w1", "lmdb", 1)  # w1 restarted: its total began again at 0
    assert _sample(m, "lmdb") == 8 and _sample(m, "shared") == 0
