"""`kvfuse bench load`: its statistics and plot, and a tiny real run through a server it starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfuse.bench.load import Sample, percentile, summarize
from kvfuse.bench.load_report import first_rate, plot, scaling, shadow_cost


def test_percentiles_interpolate_between_ranks() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0


def test_summary_counts_only_successful_requests_toward_latency_and_throughput() -> None:
    samples = [Sample(ok=True, ttft_s=0.5, gaps_s=[0.1, 0.2], completion_tokens=3, e2e_s=0.8),
               Sample(ok=True, ttft_s=1.5, gaps_s=[0.3], completion_tokens=2, e2e_s=1.8),
               Sample(ok=False, status=429)]
    row = summarize(samples, wall_s=2.0)
    assert row["requests"] == 3 and row["errors"] == 1
    assert row["ttft_p50_s"] == 1.0 and row["itl_p50_s"] == 0.2
    assert row["tokens_per_s"] == 2.5 and row["requests_per_s"] == 1.0
    assert row["served_by"] is None  # no answer named a fleet worker


def test_summary_counts_the_answers_of_each_fleet_worker() -> None:
    from kvfuse.bench.load_report import LOAD_TABLE
    from kvfuse.bench.report import markdown_table

    samples = [Sample(ok=True, worker=w) for w in ("b", "a", "b")] + [Sample(ok=False, status=503, worker="a")]
    row = summarize(samples, wall_s=1.0)
    assert row["served_by"] == {"a": 1, "b": 2}
    assert markdown_table([row], LOAD_TABLE).splitlines()[-1].endswith("| a 1, b 2 |")


def test_plot_has_one_line_per_method(tmp_path: Path) -> None:
    rows = [{"method": m, "mode": "closed", "concurrency": c, "tokens_per_s": c * k, "ttft_p50_s": 0.1 * c}
            for m, k in (("anchor", 3), ("vanilla", 1)) for c in (1, 2, 4)]
    png = plot(rows, tmp_path / "load.png")
    assert png.stat().st_size > 1000


def test_scaling_compares_the_most_streams_measured_with_one() -> None:
    rows = [{"method": m, "mode": "closed", "concurrency": c, "tokens_per_s": 10.0 * c * k, "itl_p50_s": 0.1 * c,
             "tpot_p50_s": 0.1, "requests_per_s": float(c * k)} for m, k in (("anchor", 2), ("vanilla", 1))
            for c in (1, 4)]
    anchor, vanilla = scaling(rows)
    assert anchor == {"method": "anchor", "streams": 4, "tokens_per_s_vs_1": 4.0, "itl_p50_vs_1": 4.0,
                      "tpot_p50_vs_1": 1.0, "requests_per_s_vs_vanilla": 2.0}
    assert vanilla["requests_per_s_vs_vanilla"] == 1.0
    assert scaling(rows, at=8) == []


def test_shadow_cost_compares_each_rate_with_the_first_and_counts_the_checks() -> None:
    rows = [{"shadow_rate": rate, "method": m, "mode": "closed", "concurrency": 4, "requests": 8,
             "ttft_p95_s": p95 * k, "ttft_p50_s": 0.5 * k}
            for rate, k in ((0.0, 1.0), (1.0, 1.25)) for m, p95 in (("anchor", 2.0), ("vanilla", 4.0))]
    fidelity = {"1.0": {"methods": {"anchor": {"shadowed": 7}}}, "0.0": {"methods": {}}}
    cost = shadow_cost(rows, fidelity)
    assert [(c["shadow_rate"], c["method"], c["ttft_p95_vs_base"], c["ttft_p50_vs_base"], c["checks"]) for c in cost] == [
        (0.0, "anchor", 1.0, 1.0, None), (0.0, "vanilla", 1.0, 1.0, None),
        (1.0, "anchor", 1.25, 1.25, 7), (1.0, "vanilla", 1.25, 1.25, None)]
    assert first_rate(rows) == rows[:2] and shadow_cost(rows[:0], fidelity) == []


def test_a_shadow_sweep_plots_ttft_against_the_rate(tmp_path: Path) -> None:
    from kvfuse.bench.load_report import plot_shadow

    rows = [{"shadow_rate": rate, "method": "anchor", "mode": mode, "concurrency": c, "ttft_p95_s": 1.0 + rate,
             "ttft_p50_s": 0.5, "tokens_per_s": 9.0} for rate in (0.0, 0.1, 1.0) for mode, c in (("closed", 4), ("open", None))]
    assert plot(rows, tmp_path / "a.png").stat().st_size > 1000  # one level swept: the sweep's plot
    assert plot_shadow(rows, tmp_path / "b.png").stat().st_size > 1000


def bench_load(monkeypatch: pytest.MonkeyPatch, default_llm_path: str, *args: str) -> int:
    """`kvfuse bench load ARGS` with the default model and a context the tiny runs fit in."""
    from kvfuse.cli import main

    monkeypatch.setenv("KVFUSE_MODEL_CACHE_DIR", str(Path(default_llm_path).parent))
    monkeypatch.setenv("KVFUSE_MODEL__MAX_CONTEXT_TOKENS", "1024")
    return main(["bench", "load", *args])


@pytest.mark.slow
def test_a_shadow_rate_sweep_starts_a_server_per_rate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      shared_data: Path, default_llm_path: str) -> None:
    out = tmp_path / "load.json"
    rc = bench_load(monkeypatch, default_llm_path, "--concurrency", "1", "--rounds", "2", "--max-tokens", "3",
                    "--context-tokens", "200", "--docs", "2", "--shadow-rates", "0,1", "--data-dir", str(shared_data),
                    "--json", str(out))
    assert rc == 0
    payload = json.loads(out.read_text())
    assert [(r["shadow_rate"], r["method"]) for r in payload["rows"]] == [
        (0.0, "anchor"), (0.0, "vanilla"), (1.0, "anchor"), (1.0, "vanilla")]
    assert set(payload["fidelity"]) == {"0.0", "1.0"}
    assert payload["fidelity"]["1.0"]["shadow_rate"] == 1.0 and payload["fidelity"]["0.0"]["shadow_rate"] == 0.0
    each = payload["params"]["ingest_s_each"]  # one ingestion per server, the first quoted
    assert len(each) == 2 and all(s and s > 0 for s in each) and payload["params"]["ingest_s"] == each[0]
    assert "## What shadow checks cost" in out.with_suffix(".md").read_text()
    assert bench_load(monkeypatch, default_llm_path, "--shadow-rates", "0,1", "--url", "http://127.0.0.1:9") == 2


@pytest.mark.slow
def test_tiny_load_run_through_a_real_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             shared_data: Path, default_llm_path: str) -> None:
    out = tmp_path / "load.json"
    rc = bench_load(monkeypatch, default_llm_path, "--concurrency", "1,2", "--rounds", "1", "--max-tokens", "4",
                    "--context-tokens", "400", "--rate", "4", "--open-requests", "2", "--data-dir", str(shared_data),
                    "--json", str(out))
    assert rc == 0
    payload = json.loads(out.read_text())
    rows = payload["rows"]
    assert {(r["method"], r["mode"], r["concurrency"]) for r in rows} == {
        (m, "closed", c) for m in ("anchor", "vanilla") for c in (1, 2)} | {("anchor", "open", None),
                                                                             ("vanilla", "open", None)}
    assert all(r["errors"] == 0 and r["generated_tokens"] > 0 and r["ttft_p50_s"] > 0 for r in rows)
    assert out.with_suffix(".png").is_file() and not payload["partial"]
