"""The KV memory on its own (kvfuse/fusion/engine/kv_memory.py): one buffer at the budget, contiguous
extents handed out first fit, compaction that slides only settled extents and keeps their bytes, and
caches that are views of their extent."""

from __future__ import annotations

import pytest
import torch

from kvfuse.fusion.engine.fused_cache import FusedCache
from kvfuse.fusion.engine.kv_memory import KVMemory, MemoryFull


def memory(capacity: int = 100) -> KVMemory:
    return KVMemory(2, 1, 3, capacity, torch.float32, "cpu")


def fill(mem: KVMemory, owner, value: float) -> None:
    e = mem.extent_of(owner)
    mem.k[:, :, e.start : e.stop] = value
    mem.v[:, :, e.start : e.stop] = -value


def test_the_buffers_are_the_budget_and_extents_never_exceed_it() -> None:
    mem = memory(100)
    assert mem.nbytes == 100 * mem.token_bytes == 2 * mem.k.numel() * 4
    a, b = mem.allocate("a", 60), mem.allocate("b", 40)
    assert (a.start, b.start) == (0, 60) and mem.free_tokens == 0 and mem.used_bytes == mem.nbytes
    assert not mem.can_allocate(1)
    with pytest.raises(MemoryFull, match="no 1 contiguous KV tokens free"):
        mem.allocate("c", 1)
    with pytest.raises(ValueError, match="already holds"):
        mem.allocate("a", 1)
    mem.release("a")
    assert mem.can_allocate(60) and not mem.can_allocate(61)
    assert mem.allocate("c", 10).start == 0  # first fit


def test_compaction_slides_settled_extents_down_and_keeps_their_bytes() -> None:
    mem = memory(100)
    for name, size in (("a", 30), ("b", 20), ("c", 30), ("d", 20)):
        mem.allocate(name, size)
        fill(mem, name, {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}[name])
    mem.release("a")
    mem.release("c")  # 60 free, in two holes of 30
    assert not any(mem._hole(n) is not None for n in (31, 60))
    assert not mem.can_allocate(60)  # b and d are still prefilling: nothing may move
    mem.settle("b")
    mem.settle("d")
    assert mem.can_allocate(60)
    e = mem.allocate("e", 60)
    assert (mem.extent_of("b").start, mem.extent_of("d").start, e.start) == (0, 20, 40)
    assert mem.moved_tokens == 40
    for name, value in (("b", 2.0), ("d", 4.0)):
        ext = mem.extent_of(name)
        assert torch.all(mem.k[:, :, ext.start : ext.stop] == value) and torch.all(mem.v[:, :, ext.start : ext.stop] == -value)


def test_a_pinned_extent_splits_the_room_compaction_can_make() -> None:
    mem = memory(100)
    for name, size in (("a", 20), ("pinned", 20), ("b", 20), ("c", 20)):
        mem.allocate(name, size)
    for name in ("a", "b", "c"):
        mem.settle(name)
    mem.release("a")
    mem.release("b")  # 60 free: 20 before the pinned extent, 40 after it once c slides down
    assert mem.free_tokens == 60 and mem._compactable_room() == 40
    assert mem.can_allocate(40) and not mem.can_allocate(41)
    mem.allocate("d", 40)
    assert mem.extent_of("c").start == 40 and mem.extent_of("d").start == 60


def test_a_cache_is_a_view_of_its_extent_that_follows_it() -> None:
    mem = memory(50)
    mem.allocate("gap", 10)
    cache = FusedCache.in_memory(mem, mem.allocate("seq", 20), 15)
    assert cache.k.shape == (2, 1, 15, 3) and cache.nbytes == 15 * mem.token_bytes
    cache.write(1, torch.tensor([0, 4]), torch.ones(1, 1, 2, 3), torch.full((1, 1, 2, 3), 2.0))
    assert torch.all(mem.k[1, :, 10] == 1) and torch.all(mem.v[1, :, 14] == 2)
    mem.release("gap")
    mem.settle("seq")
    mem.allocate("big", 30)  # needs the 10 freed before it plus the 20 after: seq slides to 0
    assert cache.extent.start == 0 and torch.all(cache.k[1, :, 4] == 1)
    with pytest.raises(MemoryFull, match="does not fit its extent"):
        FusedCache.in_memory(mem, mem.extent_of("seq"), 21)


def test_shrink_gives_the_tail_back_and_a_standalone_cache_owns_its_memory() -> None:
    mem = memory(40)
    mem.allocate("a", 30)
    mem.shrink("a", 12)
    assert mem.free_tokens == 28 and mem.allocate("b", 28).start == 12
    own = FusedCache(2, 1, 3, 7, torch.float32, "cpu")
    assert own.capacity == 7 and own.memory.capacity == 7 and own.memory.free_tokens == 0


def test_a_zeroed_memory_clears_what_an_extent_gives_back() -> None:
    """For kernels that read whole key blocks (the static decode path): a released extent, a shrunk tail
    and the slots compaction moved a sequence out of hold zeros again, never what a sequence left."""
    mem = KVMemory(2, 1, 3, 100, torch.float32, "cpu", zeroed=True)
    assert not mem.k.any() and not mem.v.any()
    for owner, size in (("a", 30), ("b", 20), ("c", 30)):
        mem.allocate(owner, size)
        fill(mem, owner, float("nan"))
    mem.release("a")
    assert not mem.k[:, :, :30].any() and not mem.v[:, :, :30].any()  # no NaN either: zeros
    assert mem.k[:, :, 30:80].isnan().all()
    mem.shrink("c", 10)
    assert not mem.k[:, :, 60:80].any() and mem.k[:, :, 50:60].isnan().all()
    mem.settle("b")
    mem.compact()  # b slides from [30, 50) to [0, 20): [20, 50) is left behind
    assert mem.extent_of("b").start == 0 and mem.k[:, :, :20].isnan().all() and mem.v[:, :, :20].isnan().all()
    assert not mem.k[:, :, 20:50].any() and not mem.v[:, :, 20:50].any()
    # not zeroed: released bytes stay as they were (nothing pays for clearing them)
    plain = memory(10)
    plain.allocate("a", 10)
    fill(plain, "a", 3.0)
    plain.release("a")
    assert (plain.k == 3.0).all()


def test_an_aligned_memory_gives_each_extent_whole_blocks() -> None:
    mem = KVMemory(1, 1, 1, 64, torch.float32, "cpu", align=16)
    a, b = mem.allocate("a", 1), mem.allocate("b", 17)
    assert (a.start, a.tokens, b.start, b.tokens) == (0, 16, 16, 32)  # no block holds two sequences
    assert mem.can_allocate(16) and not mem.can_allocate(17)
    mem.shrink("b", 5)
    assert b.tokens == 16 and mem.allocate("c", 30).start == 32
    assert mem.free_tokens == 0 and FusedCache.in_memory(mem, a, 1).capacity == 1  # less than its extent
    with pytest.raises(ValueError, match="whole number of 16-token blocks"):
        KVMemory(1, 1, 1, 40, torch.float32, "cpu", align=16)


def test_can_allocate_without_some_owners_says_whether_releasing_them_makes_the_room() -> None:
    mem = memory(100)
    mem.allocate("a", 30)
    mem.allocate("b", 40)  # pinned (prefilling) at [30, 70)
    mem.allocate("c", 30)
    assert not mem.can_allocate(50) and not mem.can_allocate(50, without={"a"})  # 30 + 0 in one run: no
    assert mem.can_allocate(60, without={"a", "c"}) is False and mem.can_allocate(30, without={"c"})
    mem.settle("b")  # movable: compaction gathers the free tokens around it
    assert mem.can_allocate(60, without={"a", "c"}) and not mem.can_allocate(61, without={"a", "c"})
    assert [e.owner for e in mem.extents] == ["a", "b", "c"]  # asking moved and released nothing


def test_holds_count_bytes_outside_the_buffer_against_the_budget() -> None:
    """A hold takes whole tokens of the count (its bytes rounded up), no extent may use them while it is
    held, and a reclaimable one is dropped, oldest first, when an extent needs its room."""
    mem = memory(100)
    dropped: list[str] = []
    assert mem.hold("p1", 10 * mem.token_bytes + 1, "prefix", reclaim=lambda: dropped.append("p1"))  # 11 tokens
    assert mem.hold("p2", 9 * mem.token_bytes, "prefix", reclaim=lambda: dropped.append("p2"))
    assert mem.hold("fixed", 5 * mem.token_bytes, "prefix")  # never reclaimed by the memory
    assert (mem.held_tokens, mem.used_tokens, mem.free_tokens) == (25, 25, 75)
    assert not mem.hold("big", 76 * mem.token_bytes, "prefix")  # more than is free: nothing held
    assert mem.bytes_by_kind() == {"prefix": 25 * mem.token_bytes}
    mem.allocate("a", 70, kind="query")
    assert dropped == [] and mem.free_tokens == 5
    mem.touch("p1")  # used: p2 is now the older one
    assert mem.can_allocate(25) and not mem.can_allocate(26)  # the fixed hold is never reclaimed
    mem.allocate("b", 10, kind="shadow")
    assert dropped == ["p2"] and set(mem.holds) == {"p1", "fixed"}
    assert mem.used_tokens == 96 <= mem.capacity and mem.peak_tokens == 96
    with pytest.raises(MemoryFull):
        mem.allocate("c", 20)
    assert mem.bytes_by_kind() == {"query": 70 * mem.token_bytes, "shadow": 10 * mem.token_bytes,
                                   "prefix": 16 * mem.token_bytes}
    mem.unhold("fixed")
    assert mem.free_tokens == 9


def test_the_ledger_is_the_budget_with_carves_beside_the_buffer() -> None:
    """Carves (the device tier) are set aside from the budget, the buffer is the rest, and the ledger
    reports every holder's bytes, the total and its peak."""
    from kvfuse.fusion.engine.ledger import Carve, Ledger, carved_tokens

    tier = {"bytes": 0}
    probe = memory(1)
    carve = Carve("device_tier", 30 * probe.token_bytes - 1, lambda: tier["bytes"])
    assert carved_tokens([carve], probe.token_bytes) == 30  # rounded up: the buffer never reaches into it
    mem = memory(100 - 30)
    ledger = Ledger(mem, 100, [carve], "cpu")
    assert ledger.budget_bytes == 100 * mem.token_bytes == mem.nbytes + 30 * mem.token_bytes
    mem.allocate("a", 40, kind="query")
    mem.allocate(("ingest", 1), 20, kind="ingest")
    tier["bytes"] = 25 * mem.token_bytes
    report = ledger.report()
    assert report.holders == {"query": 40 * mem.token_bytes, "shadow": 0, "ingest": 20 * mem.token_bytes,
                              "prefix": 0, "load": 0, "device_tier": 25 * mem.token_bytes}
    assert report.used_bytes == 85 * mem.token_bytes == report.peak_bytes <= report.budget_bytes
    mem.release(("ingest", 1))
    again = ledger.report()
    assert again.used_bytes == 65 * mem.token_bytes and again.peak_bytes == 85 * mem.token_bytes
    assert again.peak_holders["ingest"] == 20 * mem.token_bytes and again.caps == {"device_tier": carve.cap_bytes}
    assert again.as_dict()["holders"] == again.holders


def test_a_loads_own_hold_and_the_room_kept_for_a_requeued_query_are_owned_apart() -> None:
    """A load holds its transient KV (ledger.transient) while rooms kept for requeued queries' loads are
    held too (Scheduler.requeue): whatever the turn number of the load and the job ids waiting, neither
    takes the other's owner (a shared owner raised 'already holds' and failed the load), and the room
    and the load each count as `load` in the ledger."""
    from kvfuse.fusion.engine import ledger as L
    from kvfuse.fusion.engine.scheduler import _load_room

    mem = memory(1000)
    ledger = L.Ledger(mem, 1000)
    first = next(L._transients)  # the next loads' turn numbers are the job ids below
    for job in range(first, first + 8):
        assert mem.hold(_load_room(job), 2 * mem.token_bytes, "load")
    for _ in range(8):
        with L.transient(ledger, 10, "a load"):
            assert ledger.holders()["load"] == (8 * 2 + 10) * mem.token_bytes
    assert ledger.holders()["load"] == 8 * 2 * mem.token_bytes
