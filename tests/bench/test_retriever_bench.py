"""`kvfuse bench retriever --json` runs end to end on a small sweep and reports every figure, the
retrieval modes' part included (a few MuSiQue questions over their own passages)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_bench_retriever_json(capsys, shared_data, tmp_path):
    from kvfuse.cli import main

    out = tmp_path / "retriever.json"
    rc = main(["bench", "retriever", "--json", str(out), "--sizes", "600", "--queries", "12", "--max-chunks", "3",
               "--modes-questions", "4", "--modes-chunk-tokens", "512,128", "--rrf-ks", "1,60",
               "--no-progress", "--data-dir", str(shared_data)])
    assert rc == 0
    result = json.loads(out.read_text())
    embed = result["embed"]
    assert embed["chunks"] == 3 and embed["chunks_per_s"] > 0 and embed["llm_tokens"] > 3 * 256
    rows = {r["index_type"]: r for r in result["search"]}
    assert set(rows) == {"flat", "hnsw"}
    for r in rows.values():
        assert r["vectors"] == 600 and r["top_k"] == 4 and r["queries"] == 12
        assert 0 < r["median_ms"] <= r["p95_ms"] and r["build_s"] > 0 and r["disk_bytes"] > 600 * 384 * 4
    assert 0.5 < rows["hnsw"]["recall_at_k_vs_flat"] <= 1.0

    small, large = result["modes"]
    assert (small["chunk_tokens"], large["chunk_tokens"]) == (512, 128) and 30 < small["passages"] <= 40
    assert large["chunks"] > small["chunks"] >= 40 and small["questions"] == 4
    for r in (small, large):
        assert [m["mode"] for m in r["modes"]] == ["dense", "keyword", "hybrid"]
        for m in r["modes"]:
            assert 0 <= m["recall_at_1"] <= m["recall_at_4"] <= m["recall_at_10"] <= 1
            assert 0 <= m["mrr_at_10"] <= 1 and 0 < m["latency_p50_ms"] <= m["latency_p95_ms"]
            assert m["timed_queries"] == 3 * 4
            lo, hi = m["recall_at_4_ci"]
            assert lo <= m["recall_at_4"] <= hi
        assert set(r["paired_recall_at_4"]) == {"hybrid-dense", "hybrid-keyword"}
        assert [s["rrf_k"] for s in r["rrf_k_sweep"]] == [1, 60]
        assert r["rrf_k_sweep"][1]["recall_at_4"] == r["modes"][2]["recall_at_4"]  # the configured k = 60
        assert r["build"]["keyword"]["disk_bytes"] > 0 and r["build"]["dense"]["disk_bytes"] > 0
    assert out.with_suffix(".png").stat().st_size > 0
    assert "| hybrid |" in out.with_suffix(".md").read_text()
