"""The harness end to end on a tiny subset with the real model, so it cannot rot: the CLI runs, the
JSON rows have their schema, vanilla is the reference, a selective method at ratio 1.0 answers as
vanilla, and the plots are real PNGs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfuse.bench.fidelity import FIDELITY_COLUMNS, FLOOR, FLOOR_FP8
from kvfuse.bench.speed import SPEED_COLUMNS
from kvfuse.cli import main

pytestmark = pytest.mark.slow
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def model_env(default_llm_path: str):
    """Point the CLI's settings at the shared prepared model cache (the model is loaded by the CLI)."""
    from kvfuse.config import get_settings

    mp = pytest.MonkeyPatch()
    mp.setenv("KVFUSE_MODEL_CACHE_DIR", str(Path(default_llm_path).parent))
    get_settings.cache_clear()
    yield
    mp.undo()
    get_settings.cache_clear()


def test_fidelity_fast_subset(model_env, tmp_path: Path, capsys):
    out = tmp_path / "fidelity.json"
    # 48-token chunks: musique's 10 passages stay a ~500-token context (the test's cost is its prefills)
    rc = main(["bench", "fidelity", "--task", "needle,musique", "--n", "2", "--docs", "3", "--doc-tokens", "48",
               "--methods", "vanilla,a3", "--ratios", "1.0", "--max-tokens", "16", "--json", str(out),
               "--kv-formats", "float16,int4",
               "--reference-dir", str(tmp_path / "refs")])
    assert rc == 0
    payload = json.loads(out.read_text())
    rows = payload["rows"]
    # the floor (vanilla with two fact-free chunks swapped) runs where the facts are known: not on musique;
    # its second perturbation (vanilla's own documents' KV in fp8) everywhere; a3 once per KV format
    assert {(r["task"], r["method"], r["ratio"]) for r in rows} == {
        (t, m, 1.0) for t in ("needle", "musique") for m in ("vanilla", "a3[float16]", "a3[int4]", FLOOR_FP8)
    } | {("needle", FLOOR, 1.0)}
    for r in rows:
        assert set(FIDELITY_COLUMNS) <= set(r)
        assert r["n"] == 2 and 0.0 <= r["score"] <= 1.0 and r["ttft_s_median"] > 0
    for r in (r for r in rows if r["method"] == "vanilla"):
        assert r["score_vs_vanilla"] == 1.0 and r["ttft_vs_vanilla"] == 1.0
        assert r["kl_vs_vanilla"] == pytest.approx(0.0, abs=1e-9)
    # ratio 1.0 recomputes everything: the same answers as vanilla, the same first-token distribution
    by_example = {}
    for o in payload["outcomes"]:
        by_example.setdefault((o["task"], o["example_id"]), {})[o["method"]] = o
    assert len(by_example) == 4
    for runs in by_example.values():
        if FLOOR in runs:  # the neutral change: vanilla again, compared with vanilla's own answer
            assert runs[FLOOR]["answer_kl_vs_vanilla"] >= 0.0 and runs[FLOOR]["recomputed_tokens"] == runs[FLOOR]["context_tokens"]
        for a3 in ("a3[float16]", "a3[int4]"):  # whatever the chunks were stored in: recomputed, not read
            assert runs[a3]["prediction"] == runs["vanilla"]["prediction"]
            assert runs[a3]["recomputed_tokens"] == runs[a3]["context_tokens"]
            assert runs[a3]["kl_vs_vanilla"] < 1e-3 and runs[a3]["answer_kl_vs_vanilla"] < 1e-3
        assert 0.0 <= runs[FLOOR_FP8]["answer_kl_vs_vanilla"] < 0.05  # fp8 KV: a small, nonzero change
    for r in (r for r in rows if r["method"].startswith("a3")):
        assert r["same_answer_vs_vanilla"] == 1.0 and r["score"] == pytest.approx(
            next(v["score"] for v in rows if v["method"] == "vanilla" and v["task"] == r["task"]))
        assert r["vs_float16_gap"] == (None if r["method"] == "a3[float16]" else 0.0)
    # vanilla on 4 examples and the floor on the 2 needles, each kept for the next run
    assert payload["vanilla_references"]["computed"] == 6 and payload["vanilla_references"]["reused"] == 0
    assert "kvfuse bench fidelity --task needle,musique --n 2 --docs 3" in payload["command"]
    assert payload["command"].startswith("KVFUSE_MODEL_CACHE_DIR=")  # the environment override is recorded
    assert "--methods vanilla,a3 " in payload["command"] and "--ratios 1 " in payload["command"]
    assert payload["machine"]["torch"]
    assert out.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC
    assert "| needle | a3[int4] |" in out.with_suffix(".md").read_text()
    assert "| vanilla |" in capsys.readouterr().out


def test_speed_runs_whole_over_every_method(model_env, tmp_path: Path):
    """`kvfuse bench speed` as shipped (every registered method, cold reads included) at a small setting,
    so a method the bench cannot run fails here; one run, read for what each row must hold. kvlink, with
    the artifact the package ships, adds its K link rows (config's link_tokens) after each chunk to the
    fused cache."""
    from kvfuse.config import FusionSettings
    from kvfuse.fusion import available_methods

    out = tmp_path / "speed.json"
    rc = main(["bench", "speed", "--contexts", "256,512", "--doc-tokens", "128", "--ratio", "0.15",
               "--repeats", "1", "--max-tokens", "2", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    methods = {"vanilla", *available_methods()}
    assert sorted((r["target_context_tokens"], r["method"]) for r in rows) == sorted(
        (c, m) for c in (256, 512) for m in methods)
    assert out.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC
    for r in rows:
        assert set(SPEED_COLUMNS) <= set(r)
        assert r["ttft_s_median"] > 0 and r["ttft_cold_s_median"] > 0 and r["peak_rss_mb"] >= 0
        assert 0.5 * r["target_context_tokens"] <= r["context_tokens"] <= 1.2 * r["target_context_tokens"]
        if r["method"] == "vanilla":
            assert r["ttft_vs_vanilla"] == 1.0 and r["kv_load_s"] == 0 and r["kv_loaded_share"] == 0
        elif r["method"] == "a3":
            assert r["kv_load_s"] > 0 and r["kv_bytes"] > 0 and r["ratio"] == 0.15
            assert 0 < r["recomputed_tokens"] < r["context_tokens"]
    at = {r["method"]: r for r in rows if r["target_context_tokens"] == 512}
    k = FusionSettings().link_tokens
    links = at["kvlink"]["fused_cache_tokens"] - at["vanilla"]["fused_cache_tokens"]
    assert links > 0 and links % k == 0


def test_speed_reports_samkv_loaded_share_and_cache_size(model_env, tmp_path: Path):
    """samkv reads only its blocks from the cold store: a share below anchor's whole reads, a smaller cache
    (chunks of several blocks: at the whole run's 128 tokens it selects them all)."""
    out = tmp_path / "speed.json"
    rc = main(["bench", "speed", "--contexts", "1024", "--doc-tokens", "512", "--methods", "samkv,anchor",
               "--ratio", "0.15", "--repeats", "1", "--max-tokens", "4", "--json", str(out)])
    assert rc == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["vanilla"]["kv_loaded_share"] == 0 and rows["anchor"]["kv_loaded_share"] == 1.0
    sam, anchor = rows["samkv"], rows["anchor"]
    assert 0 < sam["kv_loaded_share"] < 1 and 0 < sam["kv_loaded_mb"] < anchor["kv_loaded_mb"]
    assert sam["fused_cache_tokens"] < anchor["fused_cache_tokens"] == rows["vanilla"]["fused_cache_tokens"]
    assert sam["fused_cache_mb"] < anchor["fused_cache_mb"] and sam["kv_load_s"] > 0


def test_evict_fidelity_fast_subset(model_env, tmp_path: Path):
    """`kvfuse bench evict`'s fidelity half end to end: each example decoded without eviction (C = 0, the
    reference) and with the cache cut to C after the first token, through the engine's own decode loop."""
    out = tmp_path / "evict.json"
    rc = main(["bench", "evict", "--contexts", "512", "--capacities", "256", "--n", "1", "--steps", "0",
               "--task", "needle", "--doc-tokens", "128", "--max-tokens", "8", "--json", str(out)])
    assert rc == 0
    payload = json.loads(out.read_text())
    outcomes = payload["outcomes"]
    assert sorted(o["capacity"] for o in outcomes) == [0, 256]
    full = next(o for o in outcomes if o["capacity"] == 0)
    assert full["same_as_full"] and full["cache_tokens"] == full["prompt_tokens"] > 256
    assert all(o["ttft_s"] > 0 and 0.0 <= o["score"] <= 1.0 for o in outcomes)
    assert {r["capacity"] for r in payload["fidelity_rows"]} == {0, 256}
