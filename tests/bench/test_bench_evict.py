"""`kvfuse bench evict`'s aggregation: agreement and scores per C against the same example without
eviction, and one report from a timing run and a fidelity run (--combine)."""

from __future__ import annotations

import json

from kvfuse.bench.eviction import aggregate_fidelity, combine


def _outcome(example: str, capacity: int, prediction: str, score: float, ctx: int = 4096) -> dict:
    return {"task": "needle", "example_id": example, "capacity": capacity, "context_tokens": ctx - 10,
            "prompt_tokens": ctx + 40, "cache_tokens": capacity or ctx + 40, "prediction": prediction,
            "same_as_full": None, "score": score, "ttft_s": 1.0, "target_context_tokens": ctx}


def _run(outcomes: list[dict]) -> list[dict]:
    full = {o["example_id"]: o["prediction"] for o in outcomes if o["capacity"] == 0}
    return [{**o, "same_as_full": o["prediction"] == full[o["example_id"]]} for o in outcomes]


def test_agreement_and_scores_per_capacity() -> None:
    outs = _run([_outcome("a", 0, "123", 1.0), _outcome("a", 512, "12", 0.0), _outcome("a", 1024, "123", 1.0),
                 _outcome("b", 0, "7", 0.0), _outcome("b", 512, "7", 0.0), _outcome("b", 1024, "7", 0.0)])
    rows = {r["capacity"]: r for r in aggregate_fidelity(outs, 4096)}
    assert rows[0]["agreement"] == 1 and rows[512]["agreement"] == 0.5 and rows[1024]["agreement"] == 1
    assert rows[512]["score"] == 0.0 and rows[512]["score_full"] == 0.5 and rows[1024]["score"] == 0.5
    assert rows[512]["n"] == 2 and abs(rows[512]["capacity_share"] - 512 / 4136) < 1e-12


def test_combine_writes_one_report_from_a_timing_and_a_fidelity_run(tmp_path) -> None:
    speed_row = {"target_context_tokens": 4096, "context_tokens": 4086, "prompt_tokens": 4136, "capacity": 512,
                 "capacity_share": 0.12, "cache_mb": 23.0, "peak_rss_mb": 200.0, "streams": 8,
                 "decode_tok_s": 30.0, "decode_vs_full": 2.0, "bandwidth_model_vs_full": 2.5}
    params = {"method": "a3", "ratio": 0.15, "repeats": 3, "steps": 16, "tasks": ["needle"], "n": 1}
    timing = {"command": "kvfuse bench evict --n 0", "machine": {}, "params": {**params, "n": 0},
              "speed_rows": [speed_row], "outcomes": []}
    fidelity = {"command": "kvfuse bench evict --steps 0", "machine": {}, "params": params, "partial": True,
                "speed_rows": [], "outcomes": _run([_outcome("a", 0, "1", 1.0), _outcome("a", 512, "1", 1.0),
                                                    _outcome("b", 0, "2", 1.0)])}  # b cut short: only C = 0
    paths = []
    for name, run in (("speed", timing), ("fidelity", fidelity)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(run))
    md, _png = combine(paths, tmp_path / "evict.json")
    payload = json.loads((tmp_path / "evict.json").read_text())
    assert payload["speed_rows"] == [speed_row] and payload["partial"]
    assert {r["capacity"]: r["n"] for r in payload["fidelity_rows"]} == {0: 2, 512: 1}
    text = md.read_text()
    assert "kvfuse bench evict --n 0; kvfuse bench evict --steps 0" in text and "| 4086 | 4136 | 512 |" in text
