"""The eviction policies against their definitions (kvfuse/store/eviction_policy.py): each victim order is
the one the definition gives, checked against a direct reference model on random operations where one is
short to write, and on hand-built cases where the definition's point is a particular sequence."""

from __future__ import annotations

import random

import pytest

from kvfuse.store.eviction_policy import LFU, LRU, POLICIES, S3FIFO, CostAware, make_policy


def _random_ops(seed: int, n: int = 600, keys: int = 40):
    rng = random.Random(seed)
    for _ in range(n):
        k = f"k{rng.randrange(keys)}"
        yield rng.choice(("insert", "access", "access", "remove", "evict")), k, rng.randrange(1, 5)


@pytest.mark.parametrize("seed", range(3))
def test_lru_and_lfu_match_reference_models(seed: int) -> None:
    """LRU evicts the key whose last insert or read is oldest; LFU the fewest reads since insertion, the
    least recently touched of equal counts, as a brute-force scan over (reads, last touch) says."""
    lru, lfu = LRU(10**9), LFU(10**9)
    touched: dict[str, int] = {}
    reads: dict[str, int] = {}
    tick = 0
    for op, key, size in _random_ops(seed):
        tick += 1
        if op == "insert" and key not in touched:
            lru.insert(key, size), lfu.insert(key, size)
            touched[key], reads[key] = tick, 0
        elif op == "access":
            assert lru.access(key) == lfu.access(key) == (key in touched)
            if key in touched:
                touched[key], reads[key] = tick, reads[key] + 1
        elif op == "remove":
            assert lru.remove(key) == lfu.remove(key) == (key in touched)
            touched.pop(key, None), reads.pop(key, None)
        elif op == "evict" and touched:
            want_lru = min(touched, key=touched.__getitem__)
            want_lfu = min(touched, key=lambda k: (reads[k], touched[k]))
            assert lru.victims(1) == [want_lru]
            assert lfu.victims(1) == [want_lfu]
            lru.remove(want_lfu), lfu.remove(want_lru)  # keep both holding the same keys
            for k in {want_lru, want_lfu}:
                touched.pop(k), reads.pop(k)
        assert set(lru.sizes) == set(lfu.sizes) == set(touched)
        assert lru.bytes == lfu.bytes == sum(lru.sizes.values())


def test_victims_free_enough_bytes_and_skip_pinned() -> None:
    for name in POLICIES:
        p = make_policy(name, 100)
        for i in range(10):
            p.insert(f"k{i}", 10, cost=10.0)
        got = p.victims(25, pinned={"k0", "k1", "k2"})
        assert len(got) == 3 and not {"k0", "k1", "k2"} & set(got), name  # 3 x 10 bytes >= 25
        assert p.bytes == 70 and len(p) == 7
        rest = sorted(set(p.sizes) - {"k0"})
        assert sorted(p.victims(10**6, pinned={"k0"})) == rest, name
        assert list(p.sizes) == ["k0"] and p.victims(1, pinned={"k0"}) == []
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("mru", 1)


def test_cost_aware_is_greedy_dual_size_frequency() -> None:
    """Priority L + reads x cost / bytes: the lowest goes first, and L becomes the victim's priority."""
    p = CostAware(10**9)
    p.insert("cheap", 100, cost=1.0)  # 1 x 1 / 100 = 0.01
    p.insert("dear", 100, cost=5.0)  # 0.05
    p.insert("big", 1000, cost=5.0)  # 0.005
    assert p.victims(1) == ["big"] and p.clock == pytest.approx(0.005)
    p.access("cheap")  # 2 x 1 / 100 = 0.02 + L, still below dear's 0.05
    assert p.priority("cheap") == pytest.approx(0.005 + 0.02)
    assert p.victims(1) == ["cheap"] and p.clock == pytest.approx(0.025)
    p.insert("late", 100, cost=1.0)  # a newcomer starts at L: 0.025 + 0.01, below dear
    assert p.victims(1) == ["late"]
    for _ in range(20):  # once L has risen past dear's priority, a fresh chunk outranks it: dear ages out
        p.insert("x", 1, cost=1.0)
        p.victims(1, pinned={"dear"})
    p.insert("fresh", 100, cost=5.0)
    assert p.victims(1) == ["dear"]


def test_s3fifo_one_hit_wonders_leave_from_the_small_fifo() -> None:
    """New chunks enter the small FIFO (10% of the budget); a chunk at its tail not read since it came in
    goes (its key to the ghost), one read since moves to the main FIFO."""
    p = S3FIFO(1000)
    for k in ("m", "once", "twice"):  # 150 bytes: past the small FIFO's 10%, victims come from it
        p.insert(k, 50)
    p.access("m")
    assert p.victims(1) == ["once"] and "once" in p.ghost
    assert "m" in p.main and p.freq["m"] == 0  # moved, its count cleared
    # a chunk inserted while its key is in the ghost enters the main FIFO straight away
    p.insert("once", 50)
    assert "once" in p.main and "once" not in p.ghost


def test_s3fifo_main_fifo_reinserts_with_a_two_bit_count() -> None:
    p = S3FIFO(10_000)  # small share 1000 bytes: the small FIFO below it, victims come from main
    for k in ("a", "b", "c"):
        p.insert(k, 10)
        p.access(k)
    p.small_bytes, p.main_bytes = 0, 30  # move them as the small FIFO's tail would
    p.main.update(p.small)
    p.small.clear()
    p.freq.update(a=0, b=3, c=1)
    for _ in range(5):
        p.access("b")
    assert p.freq["b"] == 3  # capped
    assert p.victims(1) == ["a"]  # a: no count left
    assert p.victims(1) == ["c"]  # round the FIFO: b 3->2, c 1->0, b 2->1, then c at the tail at 0 goes
    assert p.freq["b"] == 1 and list(p.main) == ["b"]


def test_s3fifo_ghost_holds_as_many_keys_as_the_tier_holds_chunks() -> None:
    p = S3FIFO(100)
    for i in range(40):
        p.victims(p.bytes + 10 - 100)
        p.insert(f"k{i}", 10)
    assert len(p.ghost) == 9 and list(p.ghost) == [f"k{i}" for i in range(21, 30)]  # the newest victims
    assert p.bytes == sum(p.sizes.values()) <= 100
    assert p.small_bytes + p.main_bytes == p.bytes
