"""The reload-or-recompute policy (kvfuse/service/worker/reload_policy.py): pure arithmetic over measured
rates, so these tests give it rates and chunks and read its plan."""

from __future__ import annotations

import threading

import pytest

from kvfuse.service.worker import reload_policy as P

MB = 1 << 20


def test_an_ewma_starts_at_its_first_sample_and_follows_later_ones() -> None:
    e = P.Ewma(0.25)
    assert e.value is None
    e.add(100.0)
    assert e.value == 100.0
    e.add(200.0)
    assert e.value == 125.0 and e.samples == 2
    with pytest.raises(ValueError):
        P.Ewma(0.0)


def test_nothing_measured_means_read_and_a_miss_is_computed() -> None:
    rates = P.Rates(0.2)
    plan = P.plan([P.Chunk("lmdb", 4 * MB, 512), P.Chunk(None, 4 * MB, 512)], rates)
    assert [(c.decision, c.reason) for c in plan] == [(P.READ, P.UNMEASURED), (P.RECOMPUTE, P.MISS)]
    rates.observe_read("lmdb", 4 * MB, 0.002)  # a read rate alone still decides nothing
    assert P.plan([P.Chunk("lmdb", 4 * MB, 512)], rates)[0].reason == P.UNMEASURED


def test_a_tier_slower_than_the_engine_is_recomputed_and_a_fast_one_read() -> None:
    rates = P.Rates(0.2)
    rates.observe_precompute(2000, 1.0)  # 2000 tokens/s
    rates.observe_read("lmdb", 2000 * MB, 1.0)  # 2 GB/s
    rates.observe_read("shared", 1 * MB, 1.0)  # 1 MB/s: a congested link
    chunks = [P.Chunk("lmdb", 11 * MB, 512), P.Chunk("shared", 11 * MB, 512), P.Chunk("hot", 11 * MB, 512)]
    plan = P.plan(chunks, rates)
    assert [(c.decision, c.reason) for c in plan] == [
        (P.READ, P.FASTER), (P.RECOMPUTE, P.SLOWER), (P.READ, P.UNMEASURED)]
    assert plan[1].read_s == pytest.approx(11.0) and plan[1].recompute_s == pytest.approx(0.256)
    assert P.counts(plan) == {"read:read_faster": 1, "recompute:read_slower": 1, "read:unmeasured": 1}


def test_a_tiers_chunks_share_its_bandwidth_and_go_together() -> None:
    """Each chunk alone reads faster than it computes, but together they saturate the tier: all recomputed."""
    rates = P.Rates(1.0)
    rates.observe_precompute(1000, 1.0)
    rates.observe_read("shared", 10 * MB, 1.0)  # 10 MB/s
    one = [P.Chunk("shared", 4 * MB, 512)]  # 0.4 s to read, 0.512 s to compute
    assert P.plan(one, rates)[0].decision == P.READ
    # the same chunk, stored at a quarter of the bytes, stays read as the query grows further
    assert all(c.decision == P.READ for c in P.plan([P.Chunk("shared", 1 * MB, 512)] * 4, rates))
    many = [P.Chunk("shared", 4 * MB, 512), P.Chunk("shared", 4 * MB, 64)]  # 0.8 s against 0.576 s
    assert [c.decision for c in P.plan(many, rates)] == [P.RECOMPUTE, P.RECOMPUTE]


def test_rates_follow_observations_from_many_threads() -> None:
    rates = P.Rates(0.5)

    def reads() -> None:
        for _ in range(200):
            rates.observe_read("lmdb", 1000, 0.001)

    threads = [threading.Thread(target=reads) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert rates.reads["lmdb"].samples == 800 and rates.read_rate("lmdb") == pytest.approx(1e6)
    rates.observe_read("lmdb", 0, 0.1)  # nothing read: not a sample
    rates.observe_precompute(100, 0.0)
    assert rates.reads["lmdb"].samples == 800 and rates.precompute_tps.value is None
    assert rates.snapshot() == {"read_bps_lmdb": pytest.approx(1e6), "read_latency_s_lmdb": 0.0,
                                "precompute_tokens_per_s": None}


def test_latency_and_bandwidth_are_told_apart_by_reads_of_two_sizes() -> None:
    """time = latency + bytes / bandwidth: an object store's 40 ms per GET at 100 MB/s. Reads of one size
    give the rate of that size; reads of two sizes recover both, and a query of many small chunks pays
    the latency per round of `parallel` requests, which makes recomputing them win where the bandwidth
    alone says read."""
    rates = P.Rates(0.1)
    for _ in range(50):
        for nbytes in (1 * MB, 8 * MB):
            rates.observe_read("object", nbytes, 0.040 + nbytes / 100e6)
    latency, bps = rates.reads["object"].line()
    assert latency == pytest.approx(0.040, rel=1e-3) and bps == pytest.approx(100e6, rel=1e-3)
    assert rates.read_seconds("object", 4 * MB, 2) == pytest.approx(0.080 + 4 * MB / 100e6, rel=1e-3)
    rates.observe_precompute(4000, 1.0)  # 4000 tokens/s
    small = [P.Chunk("object", 256 << 10, 64)] * 16  # 16 ms each: 4 MB in 42 ms, but 16 GETs
    assert all(c.decision == P.RECOMPUTE for c in P.plan(small, rates, parallel=1))  # 0.68 s against 0.256 s
    assert all(c.decision == P.READ for c in P.plan(small, rates, parallel=16))  # one round: 0.082 s
    one_size = P.Rates(0.1)
    one_size.observe_read("lmdb", 2 * MB, 0.002)
    assert one_size.reads["lmdb"].line() == (0.0, pytest.approx(2 * MB / 0.002))


def test_a_tier_judged_slower_is_read_again_now_and_then_and_its_rate_follows_it() -> None:
    """Judged slower, a tier is not read, so nothing measures it: every `probe_every` plans that judge it
    so, one reads it (reason `probe`); the reads it then serves move its rate, and once it recovered it
    is read again."""
    rates = P.Rates(1.0, probe_every=3)
    rates.observe_precompute(1000, 1.0)
    rates.observe_read("shared", 1 * MB, 1.0)  # 1 MB/s: congested
    chunk = [P.Chunk("shared", 4 * MB, 512)]  # 4 s to read, 0.512 s to compute
    reasons = [P.plan(chunk, rates)[0].reason for _ in range(6)]
    assert reasons == [P.SLOWER, P.SLOWER, P.PROBE, P.SLOWER, P.SLOWER, P.PROBE]
    assert P.plan(chunk, rates)[0].decision == P.RECOMPUTE
    probe = next(c for c in iter(lambda: P.plan(chunk, rates)[0], None) if c.reason == P.PROBE)
    assert probe.decision == P.READ
    rates.observe_read("shared", 4 * MB, 0.004)  # what the probe's read saw: the link recovered
    assert P.plan(chunk, rates)[0].reason == P.FASTER
    never = P.Rates(1.0, probe_every=0)
    never.observe_precompute(1000, 1.0)
    never.observe_read("shared", 1 * MB, 1.0)
    assert all(P.plan(chunk, never)[0].reason == P.SLOWER for _ in range(50))


def test_the_bytes_a_chunk_reads_are_those_of_its_own_format() -> None:
    """A store holds chunks of several KV formats: the plan costs each by the bytes its tier keeps for it
    (ChunkStore.size, e.g. an int4 blob at 0.3x float16), not the configured format's."""
    rates = P.Rates(1.0)
    rates.observe_precompute(1000, 1.0)
    rates.observe_read("lmdb", 10 * MB, 1.0)  # 10 MB/s
    float16, int4 = P.Chunk("lmdb", 6 * MB, 512), P.Chunk("lmdb", int(0.3 * 6 * MB), 512)
    assert P.plan([float16], rates)[0].decision == P.RECOMPUTE  # 0.6 s against 0.512 s
    assert P.plan([int4], rates)[0].decision == P.READ  # 0.18 s


def test_a_cold_query_takes_the_full_prefill_when_the_time_it_saves_exceeds_the_work_it_adds() -> None:
    """full_prefill_first: saved = cold + fused - prompt tokens before the first token, added = prompt -
    fused tokens of engine work; auto takes the full prefill only when saved > added."""
    from kvfuse.service.worker.reload_policy import full_prefill_first

    # three 64-token chunks after 96-token contexts, a 240-token prompt, 44 fused rows: saves 284, adds 196
    assert full_prefill_first("auto", 3 * (64 + 96), 44, 240)
    assert not full_prefill_first("auto", 64 + 96, 44, 240)  # one cold chunk: the fused path is sooner
    # chunks cached alone, every one cold: cold = the context's tokens, within the prompt: never
    assert not full_prefill_first("auto", 192, 44, 240)
    assert not full_prefill_first("auto", 392, 44, 240)  # the boundary: saves 196, adds 196
    assert full_prefill_first("auto", 393, 44, 240)
    assert full_prefill_first("full_prefill", 1, 44, 240) and not full_prefill_first("compute", 10_000, 44, 240)
    assert not full_prefill_first("full_prefill", 0, 44, 240)  # nothing cold: the method runs
