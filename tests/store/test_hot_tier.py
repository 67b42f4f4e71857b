"""RAM hot tier: LRU by bytes, counters, thread safety."""

from __future__ import annotations

import threading

import torch

from kvfuse import kvblob
from kvfuse.store.hot_tier import HotTier


def _entry(nbytes: int):
    k = torch.zeros(nbytes // 2, dtype=torch.uint8)
    h = kvblob.KVHeader(1, "m", "float16", 1, 1, 1, 1, "t", "rope0", "crc32:0")
    return kvblob.ChunkEntry(k, k.clone(), h)  # k + v = nbytes


def test_lru_by_bytes_with_counters() -> None:
    hot = HotTier(budget_bytes=300)
    for name in "abc":
        assert hot.put(name, _entry(100))
    assert hot.get("a") is not None  # a is now the most recent: b is the oldest
    assert hot.put("d", _entry(100))
    assert hot.get("b") is None and hot.contains("c") and hot.contains("d") and hot.contains("a")
    assert not hot.put("huge", _entry(400))  # larger than the whole budget: not kept, nothing evicted
    st = hot.stats()
    assert (st["hot_hits"], st["hot_misses"], st["hot_evictions"]) == (1, 1, 1)
    assert (st["hot_bytes"], st["hot_items"]) == (300, 3)
    assert hot.remove("a") and not hot.remove("a")
    assert hot.stats()["hot_bytes"] == 200
    assert HotTier(0).put("x", _entry(2)) is False  # hot_tier_mb = 0 turns it off


def test_concurrent_use_keeps_the_byte_count_exact() -> None:
    hot = HotTier(budget_bytes=1000)

    def work(t: int) -> None:
        for i in range(300):
            hot.put(f"{t}-{i % 40}", _entry(100))
            hot.get(f"{(t + 1) % 4}-{i % 40}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    st = hot.stats()
    assert st["hot_bytes"] == 100 * st["hot_items"] <= 1000
    assert st["hot_hits"] + st["hot_misses"] == 1200


def test_a_put_evicts_before_it_keeps_so_the_bytes_never_pass_the_budget() -> None:
    """The device tier's budget is carved from the worker's one device KV ledger, so the tier evicts the
    room first: no moment holds the new entry beside the ones it pushes out."""
    hot = HotTier(budget_bytes=300, name="device")
    for name in "abc":
        assert hot.put(name, _entry(100))
    assert hot.put("big", _entry(250))  # needs all three gone
    st = hot.stats()
    assert (st["device_bytes"], st["device_items"], st["device_evictions"]) == (250, 1, 3)
    assert hot.put("big", _entry(300)) and hot.stats()["device_bytes"] == 300  # a key put again is replaced
