"""`kvfuse bench ingest`'s own arithmetic (kvfuse/bench/first_use.py): the summary's medians, ratios to
vanilla per document, and answer counts, from rows given by hand; the table renders every arm."""

from __future__ import annotations

from kvfuse.bench.first_use import _summary, render


def _q(ttft: float, answer: str = "a", method: str = "anchor", computed: int | None = 0) -> dict:
    return {"ttft_ms": ttft, "kv_compute_ms": 0.0, "chunks_computed": computed, "chunks_deferred": None,
            "method": method, "answer": answer}


def test_the_summary_takes_per_document_ratios_to_vanilla_and_counts_matching_answers() -> None:
    rows = {
        "x": {"document": "x", "chunks": 3, "cold": _q(300.0), "vanilla": _q(100.0, "v"),
              "after_warm_up": _q(20.0), "cold_auto": _q(110.0, "v", "vanilla", None), "deferred_s": 4.0,
              "after_auto": _q(25.0), "warm": _q(30.0)},
        "y": {"document": "y", "chunks": 2, "cold": _q(500.0, "b"), "vanilla": _q(250.0, "w"),
              "after_warm_up": _q(40.0, "b", computed=1), "cold_auto": _q(250.0, "w", "vanilla", None),
              "deferred_s": 6.0, "after_auto": _q(45.0, "c"), "warm": _q(50.0, "b")},
    }
    s = _summary(rows, first_use_s=2.0, ingest_s=40.0)
    assert s["documents"] == 2 and s["chunks"] == 5
    assert s["ingest_s"] == {"first_use": 2.0, "ingest": 40.0, "ratio": 0.05}
    assert s["cold_over_vanilla"] == 2.5  # the median of 3.0 and 2.0, not 400 / 175
    assert s["cold_auto_over_vanilla"] == 1.05  # 1.1 and 1.0
    assert s["ttft_ms_median"]["cold_auto"] == 180.0 and s["deferred_s_median"] == 5.0
    assert s["cold_auto_methods"] == ["vanilla"]
    assert s["answers_same_as_eager"] == 2 and s["cold_auto_same_as_vanilla"] == 2
    assert s["after_auto_same_as_eager"] == 1 and s["after_warm_up_computed"] == 1 and s["after_auto_computed"] == 0
    table = render({"summary": s, "rows": list(rows.values())}, "kvfuse bench ingest")
    assert "| x | 3 | 300.0 | 110.0 | 100.0 | 20.0 | 25.0 | 30.0 | 0.0 |" in table
    assert "`cold_chunks: auto` (default) | 180.0 | 1.05x |" in table
