"""`kvfuse bench retriever --json` runs end to end on a small sweep and reports every figure."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_bench_retriever_json(capsys, shared_data):
    from kvfuse.cli import main

    rc = main(["bench", "retriever", "--json", "--sizes", "600", "--queries", "12", "--max-chunks", "3",
               "--no-progress", "--data-dir", str(shared_data)])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    embed = result["embed"]
    assert embed["chunks"] == 3 and embed["chunks_per_s"] > 0 and embed["llm_tokens"] > 3 * 256
    rows = {r["index_type"]: r for r in result["search"]}
    assert set(rows) == {"flat", "hnsw"}
    for r in rows.values():
        assert r["vectors"] == 600 and r["top_k"] == 4 and r["queries"] == 12
        assert 0 < r["median_ms"] <= r["p95_ms"] and r["build_s"] > 0 and r["disk_bytes"] > 600 * 384 * 4
    assert 0.5 < rows["hnsw"]["recall_at_k_vs_flat"] <= 1.0
