"""The scheduler's policy on its own: admission by what the KV memory can give, batch size and prefill
work per step, first come first served, and ingestion's guaranteed share of the steps. The memory is a
real KVMemory of one-element tokens."""

from __future__ import annotations

import pytest
import torch

from kvfuse.config import ServerSettings
from kvfuse.fusion.engine.kv_memory import KVMemory
from kvfuse.fusion.engine.requests import Phase, Request, SchedulerLimits
from kvfuse.fusion.engine.scheduler import Scheduler


def sched(**kw) -> Scheduler:
    limits = SchedulerLimits(**{"max_running": 4, "kv_budget_tokens": 1000, "prefill_tokens_per_step": 300,
                                "ingest_share": 0.25, **kw})
    return Scheduler(limits, KVMemory(1, 1, 1, limits.kv_budget_tokens, torch.float32, "cpu"))


def ids(reqs: list[Request]) -> list[int]:
    return [r.job_id for r in reqs]


def test_limits_come_from_the_server_settings() -> None:
    s = ServerSettings(max_running_requests=3, kv_budget_tokens=500, prefill_tokens_per_step=64, ingest_step_share=0.5)
    assert SchedulerLimits.from_settings(s) == SchedulerLimits(3, 500, 64, 0.5)


def test_kv_budget_holds_back_the_next_request_until_one_retires() -> None:
    s = sched(prefill_tokens_per_step=10_000)
    for i in range(4):
        s.add(Request(i, kv_tokens=300, prefill_tokens=100))
    assert ids(s.schedule().admit) == [0, 1, 2]  # a fourth would hold 1200 > 1000
    assert s.kv_used == 900 and s.num_waiting == 1
    assert s.schedule().admit == []
    s.retire(1)
    assert ids(s.schedule().admit) == [3]
    for i in (0, 2, 3):
        s.prefilled(i)
    assert ids(s.decode_batch()) == [0, 2, 3] and s.kv_used == 900


def test_an_evicted_cache_frees_its_share_of_the_budget_after_the_first_token() -> None:
    s = sched(prefill_tokens_per_step=10_000)
    for i in range(3):
        s.add(Request(i, kv_tokens=400, prefill_tokens=100))
    assert ids(s.schedule().admit) == [0, 1] and s.kv_used == 800  # a third: 1200 > 1000
    s.prefilled(0, kv_tokens=150)  # evicted down to 150 tokens after its first token
    assert s.kv_used == 550 and s.running[0].kv_tokens == 150 and s.memory.free_tokens == 450
    # 450 free, but in two runs (250 after the evicted cache, 200 at the end): 1 is still prefilling,
    # its extent may not move, so 2 waits rather than overrun the memory
    assert s.schedule().admit == []
    s.prefilled(1, kv_tokens=400)  # not evicted: unchanged, and movable from now on
    assert ids(s.schedule().admit) == [2]  # 1 slid down behind 0: 950 in all
    assert s.memory.extent_of(1).start == 150 and s.memory.extent_of(2).start == 550
    s.retire(0)
    assert s.kv_used == 800 and s.memory.used_tokens == 800


def test_a_request_larger_than_the_budget_is_refused_not_queued() -> None:
    s = sched()
    assert s.fits_alone(1000) and not s.fits_alone(1001)
    with pytest.raises(ValueError, match="over the budget"):
        s.add(Request(1, kv_tokens=1001))


def test_batch_size_and_prefill_work_per_step_are_bounded() -> None:
    s = sched(max_running=3, kv_budget_tokens=10_000)
    for i in range(5):
        s.add(Request(i, kv_tokens=10, prefill_tokens=200))
    assert ids(s.schedule().admit) == [0]  # 200 + 200 > 300: one prefill in flight
    assert s.schedule().admit == []  # 0 is still prefilling
    for i in range(3):
        s.prefilled(i)
        assert ids(s.schedule().admit) == ([i + 1] if i < 2 else [])
    assert s.num_running == 3  # max_running
    big = sched()
    big.add(Request(9, kv_tokens=10, prefill_tokens=5000))  # larger than a step's budget: admitted alone
    assert ids(big.schedule().admit) == [9]


def test_only_sequences_past_their_prefill_decode() -> None:
    s = sched(prefill_tokens_per_step=1000)
    for i in range(3):
        s.add(Request(i, kv_tokens=10, prefill_tokens=300))
    assert ids(s.schedule().admit) == [0, 1, 2] and s.prefill_pending == 900
    assert ids(s.prefilling()) == [0, 1, 2] and s.decode_batch() == []
    s.prefilled(1)
    assert ids(s.prefilling()) == [0, 2] and ids(s.decode_batch()) == [1]
    s.retire(0)  # cancelled while prefilling: its pending work is gone with it
    assert s.prefill_pending == 300 and s.kv_used == 20


def test_the_head_of_the_queue_is_never_overtaken() -> None:
    s = sched(prefill_tokens_per_step=10_000)
    s.add(Request(0, kv_tokens=600))
    s.schedule()
    s.add(Request(1, kv_tokens=600))  # does not fit beside 0
    s.add(Request(2, kv_tokens=100))  # would fit, but waits its turn
    assert s.schedule().admit == []
    s.retire(0)
    assert ids(s.schedule().admit) == [1, 2]


def test_cancel_removes_a_request_wherever_it_is() -> None:
    s = sched()
    s.add(Request(1, kv_tokens=100))
    s.schedule()
    s.add(Request(2, kv_tokens=100))
    s.add_ingest(Request(3))
    assert s.remove(2).status is Phase.WAITING
    assert s.remove(1).status is Phase.PREFILLING and s.kv_used == 0
    assert s.remove(3).status is Phase.INGESTING
    assert s.remove(4) is None and not s.has_work


def test_a_request_moves_from_waiting_through_prefilling_to_decoding() -> None:
    s = sched()
    r = Request(1, kv_tokens=100, prefill_tokens=100)
    s.add(r)
    assert r.status is Phase.WAITING and s.prefilling() == [] and s.decode_batch() == []
    s.schedule()
    assert r.status is Phase.PREFILLING and s.prefilling() == [r] and s.prefill_pending == 100
    s.prefilled(1)
    assert r.status is Phase.DECODING and s.decode_batch() == [r] and s.prefill_pending == 0


def _run(s: Scheduler, steps: int, piece_s: float, step_s: float = 1.0) -> tuple[list[bool], float]:
    """`steps` steps, each `step_s` seconds of query work and, when it runs one, a piece of `piece_s`:
    which steps ran a piece, and ingestion's share of the time."""
    turns, ingest = [], 0.0
    for _ in range(steps):
        plan = s.schedule()
        took = piece_s if plan.ingest is not None else 0.0
        s.spent(plan, took, step_s)
        turns.append(plan.ingest is not None)
        ingest += took
    return turns, ingest / (ingest + steps * step_s)


def test_ingestion_gets_its_share_of_the_time_while_queries_run_and_every_idle_step() -> None:
    """Scheduler.spent: the share is of the worker's time, not its steps. Unit steps and unit pieces at a
    share of 0.25: a piece once the queries' three steps have earned it; pieces four steps long: one in
    twelve steps, ingestion still a quarter of the time (one step in four would give it four sevenths)."""
    s = sched(ingest_share=0.25)
    s.add_ingest(Request(100))
    assert s.schedule().ingest.job_id == 100  # no query needs the worker: ingestion runs
    s.add(Request(1, kv_tokens=100, prefill_tokens=10))
    turns, _ = _run(s, 12, piece_s=1.0)
    # the first piece once any query time is earned (its length unknown: it leaves a debt of 2/3 s), then
    # one piece in three steps: 3 s of queries earn 1 s
    assert turns == [False, True, False, False, False, False, True, False, False, True, False, False], turns
    turns, share = _run(s, 300, piece_s=1.0)
    assert share == pytest.approx(0.25, abs=0.01) and turns[-6:] == [True, False, False] * 2
    long = sched(ingest_share=0.25)
    long.add_ingest(Request(100))
    long.add(Request(1, kv_tokens=100, prefill_tokens=10))
    turns, share = _run(long, 400, piece_s=4.0)
    assert 0.23 <= share <= 0.27, share
    assert sum(turns) <= 400 // 12 + 2
    plan = sched(ingest_share=1.0)
    plan.add(Request(1, kv_tokens=1))
    plan.add_ingest(Request(7))
    p = plan.schedule()
    assert ids(p.admit) == [1] and p.ingest.job_id == 7 and p.ingest_tokens == 300
    s.ingest_done(100)
    assert s.schedule().ingest is None


def test_a_preemptible_request_runs_only_while_no_query_waits_and_is_preempted_for_one() -> None:
    s = sched(max_running=2, prefill_tokens_per_step=10_000)
    low = Request(-1, kv_tokens=600, prefill_tokens=600, preemptible=True)
    s.add(low)
    plan = s.schedule()
    assert ids(plan.admit) == [-1] and plan.low_prefill and s.kv_used == 600 and s.prefill_pending == 0
    assert s.prefilling() == [low] and s.prefilling(low=False) == []
    s.add(Request(1, kv_tokens=300, prefill_tokens=100))  # fits beside it: nothing preempted
    plan = s.schedule()
    assert ids(plan.admit) == [1] and plan.preempted == [] and s.prefilling() == [s.running[1], low]
    s.add(Request(2, kv_tokens=300, prefill_tokens=100))  # neither a row nor the memory is free
    plan = s.schedule()
    assert ids(plan.preempted) == [-1] and ids(plan.admit) == [2]
    assert low.status is Phase.WAITING and low.extent is None and low.preemptions == 1 == s.preemptions
    assert s.kv_used == 600 and ids(list(s.low)) == [-1]
    s.add(Request(3, kv_tokens=100))  # waits for a row: the preemptible request waits behind it
    plan = s.schedule()
    assert plan.admit == [] and not plan.low_prefill
    s.retire(1)
    assert ids(s.schedule().admit) == [3]
    s.retire(2)
    assert ids(s.schedule().admit) == [-1]  # redone once a row and its memory are free


def test_a_preemptible_request_is_no_query_work_for_ingestions_share() -> None:
    s = sched(ingest_share=0.25)
    s.add(Request(-1, kv_tokens=100, prefill_tokens=100, preemptible=True))
    s.add_ingest(Request(100))
    plans = [s.schedule() for _ in range(3)]
    assert all(p.ingest is not None and not p.low_prefill for p in plans)  # every step, as when idle
    with pytest.raises(ValueError, match="one row"):
        s.add(Request(-2, kv_tokens=10, rows=2, preemptible=True))


def test_an_ingestion_piece_waits_for_room_for_its_cache_and_preempts_for_it() -> None:
    s = sched(prefill_tokens_per_step=10_000, ingest_share=1.0)
    s.add(Request(1, kv_tokens=700, prefill_tokens=10))
    s.add_ingest(Request(100, need=lambda budget: 400))
    plan = s.schedule()
    assert ids(plan.admit) == [1] and plan.ingest is None  # 300 free: the piece's 400 wait
    s.add(Request(-1, kv_tokens=200, prefill_tokens=10, preemptible=True))
    s.retire(1)
    plan = s.schedule()
    assert ids(plan.admit) == [-1] and plan.ingest.job_id == 100 and plan.ingest_kv == 400
    s.add(Request(2, kv_tokens=500, prefill_tokens=10))
    plan = s.schedule()  # 2 lands at [200, 700), pinned while it prefills: even without -1 no 400 in one run
    assert ids(plan.admit) == [2] and plan.ingest is None and plan.preempted == []  # so -1 is not preempted
    s.prefilled(2)  # movable now: compaction can gather 500 free tokens once -1 is gone
    plan = s.schedule()
    assert plan.ingest is not None and plan.ingest_kv == 400 and ids(plan.preempted) == [-1]
    assert s.memory.can_allocate(400)
    s.add_ingest(Request(101, need=lambda budget: 5000))  # could never fit: goes ahead, fails in the core
    s.ingest_done(100)
    assert s.schedule().ingest_kv == 5000


def test_cached_system_prompts_give_way_to_a_query_that_needs_their_room() -> None:
    """Holds of the prefix cache count against the budget, so a query waits only for extents: the
    scheduler admits it by reclaiming the holds, least recently used first, and only as many as it needs."""
    s = sched(prefill_tokens_per_step=10_000)
    dropped: list[str] = []
    for name in ("old", "new"):
        assert s.memory.hold(name, 200 * s.memory.token_bytes, "prefix", reclaim=lambda n=name: dropped.append(n))
    s.add(Request(0, kv_tokens=500, prefill_tokens=100))
    assert ids(s.schedule().admit) == [0] and dropped == [] and s.kv_used == 500  # the holds are not queries'
    s.add(Request(1, kv_tokens=250, prefill_tokens=100))
    assert ids(s.schedule().admit) == [1] and dropped == ["old"]  # 100 free: one hold made the room
    assert s.memory.used_tokens == 950 <= s.memory.capacity and list(s.memory.holds) == ["new"]
