"""Aggregation, tables, plots and the README block, from hand-built outcomes (no model needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfuse.bench import report
from kvfuse.bench.fidelity import (
    FIDELITY_COLUMNS,
    FLOOR,
    FLOOR_FP8,
    Outcome,
    aggregate,
    kl_divergence,
    method_plan,
    outcome_dicts,
    paired_ratio_ci,
    split_format,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _outcome(task: str, ex: str, method: str, ratio: float, pred: str, score: float, ttft: float,
             kl: float | None = 0.0) -> Outcome:
    return Outcome(task=task, example_id=ex, method=method, ratio=ratio, prediction=pred, score=score,
                   ttft_s=ttft, context_tokens=1000, recomputed_tokens=int(1000 * ratio), kl_vs_vanilla=kl)


OUTCOMES = [
    _outcome("needle", "e0", "vanilla", 1.0, "42", 1.0, 2.0),
    _outcome("needle", "e1", "vanilla", 1.0, "7", 0.0, 4.0),
    _outcome("needle", "e0", "a3", 0.15, "42", 1.0, 0.5, 0.1),
    _outcome("needle", "e1", "a3", 0.15, "8", 0.0, 1.0, 0.3),
    _outcome("needle", "e0", "a3", 1.0, "42", 1.0, 2.0, 0.0),
    _outcome("needle", "e1", "a3", 1.0, "7", 0.0, 4.0, 0.0),
    _outcome("musique", "m0", "vanilla", 1.0, "x", 0.0, 1.0),
    _outcome("musique", "m0", "pie", 0.0, "y", 0.5, 0.2, 2.0),
    Outcome(task="musique", example_id="m0", method="epic", ratio=None, prediction="x", score=0.0,
            ttft_s=0.3, context_tokens=1000, recomputed_tokens=64),
]


def test_method_plan_runs_vanilla_first_and_fixed_methods_once():
    plan = method_plan(["a3", "pie", "vanilla", "epic"], [0.1, 1.0])
    assert plan == [("vanilla", 1.0), (FLOOR, 1.0), (FLOOR_FP8, 1.0), ("a3", 0.1), ("a3", 1.0), ("pie", 0.0),
                    ("epic", None)]
    assert method_plan(["a3", FLOOR], [0.1], floor=False) == [("vanilla", 1.0), ("a3", 0.1)]
    # with KV formats, each method once per format, float16 first
    assert method_plan(["anchor", "pie"], [0.15], floor=False, kv_formats=["int4", "float16"]) == [
        ("vanilla", 1.0), ("anchor[float16]", 0.15), ("anchor[int4]", 0.15), ("pie[float16]", 0.0), ("pie[int4]", 0.0)]
    assert split_format("anchor[int4]") == ("anchor", "int4") and split_format("anchor") == ("anchor", None)


def test_a_format_is_paired_with_float16_storage_on_the_same_examples():
    outs = []
    for i in range(20):
        outs += [_outcome("needle", f"e{i}", "vanilla", 1.0, f"{i}00.", 1.0, 2.0),
                 _outcome("needle", f"e{i}", "anchor[float16]", 0.15, f"{i}00.", 1.0, 0.5, 0.0),
                 _outcome("needle", f"e{i}", "anchor[int4]", 0.15, "9." if i < 2 else f"{i}00.", 1.0, 0.4, 0.0)]
        outs[-2].answer_kl_vs_vanilla, outs[-1].answer_kl_vs_vanilla = 0.01, 0.02
    rows = {r["method"]: r for r in aggregate(outs)}
    q = rows["anchor[int4]"]
    assert q["vs_float16_gap"] == pytest.approx(0.1) and q["vs_float16_gap_ci"][0] >= 0.0
    assert q["answer_kl_vs_float16"] == pytest.approx(2.0) and q["ttft_vs_float16"] == pytest.approx(0.8)
    assert rows["anchor[float16]"]["vs_float16_gap"] is None and rows["vanilla"]["answer_kl_vs_float16"] is None


def test_aggregate_compares_with_vanilla_on_the_same_examples():
    rows = {(r["task"], r["method"], r["ratio"]): r for r in aggregate(OUTCOMES)}
    assert all(set(FIDELITY_COLUMNS) <= set(r) for r in rows.values())
    van = rows[("needle", "vanilla", 1.0)]
    assert van["score"] == 0.5 and van["score_vs_vanilla"] == 1.0 and van["ttft_s_median"] == 3.0
    a3 = rows[("needle", "a3", 0.15)]
    assert a3["n"] == 2 and a3["score_vs_vanilla"] == 1.0 and a3["same_answer_vs_vanilla"] == 0.5
    assert a3["ttft_vs_vanilla"] == pytest.approx(0.75 / 3.0)
    assert a3["kl_vs_vanilla"] == pytest.approx(0.2) and a3["recomputed_share"] == pytest.approx(0.15)
    assert rows[("needle", "a3", 1.0)]["same_answer_vs_vanilla"] == 1.0
    # vanilla scored 0: no ratio to it, rather than a division by zero or a made-up number
    assert rows[("musique", "pie", 0.0)]["score_vs_vanilla"] is None
    # a method whose share is fixed by its chunk edges is reported at its measured share
    assert rows[("musique", "epic", 0.064)]["recomputed_share"] == pytest.approx(0.064)


def test_value_agreement_and_the_floor_are_paired_on_the_same_examples():
    # 20 examples: vanilla answers "N."; the floor changes the value of e0 only; a method keeps every value
    # but talks on after it (whole-answer agreement 0, value agreement 1), another changes e0..e5.
    outs = []
    for i in range(20):
        outs += [_outcome("needle", f"e{i}", "vanilla", 1.0, f"{i}00.", 1.0, 2.0),
                 _outcome("needle", f"e{i}", FLOOR, 1.0, "999." if i == 0 else f"{i}00.", 1.0, 2.0),
                 _outcome("needle", f"e{i}", "talks", 0.15, f"{i}00. This number is", 1.0, 1.0),
                 _outcome("needle", f"e{i}", "moves", 0.15, "5." if i < 6 else f"{i}00.", 1.0, 1.0)]
    rows = {r["method"]: r for r in aggregate(outs)}
    assert rows[FLOOR]["same_value_vs_vanilla"] == pytest.approx(0.95) and rows[FLOOR]["floor_gap"] is None
    talks, moves = rows["talks"], rows["moves"]
    assert talks["same_answer_vs_vanilla"] == 0.0 and talks["same_value_vs_vanilla"] == 1.0
    # floor agrees on 19, `talks` on 20: gap −0.05, its interval below the margin: within the floor
    assert talks["floor_gap"] == pytest.approx(-0.05) and talks["floor_gap_ci"][1] <= 0.05
    assert talks["within_floor"] == "yes"
    # `moves` changes 6 values where the floor changes 1 (e0, where both moved): gap 5/20 = 0.25
    assert moves["same_value_vs_vanilla"] == pytest.approx(0.7) and moves["floor_gap"] == pytest.approx(0.25)
    lo, hi = moves["floor_gap_ci"]
    assert lo < 0.25 < hi and moves["within_floor"] == "no"
    # a gap at the margin the run cannot bound: "not shown"
    few = [o for o in outs if o.example_id in ("e0", "e6", "e7")]
    few += [_outcome("needle", "e6", "close", 0.15, "600.", 1.0, 1.0),
            _outcome("needle", "e7", "close", 0.15, "1.", 1.0, 1.0),
            _outcome("needle", "e0", "close", 0.15, "000.", 1.0, 1.0)]  # kept where the floor moved
    close = next(r for r in aggregate(few) if r["method"] == "close")
    assert close["floor_gap"] == pytest.approx(0.0) and close["within_floor"] == "not shown"
    # nothing changed on 3 examples: a zero-width interval, yet too few examples to claim it
    same = [o for o in outs if o.example_id in ("e6", "e7", "e8") and o.method in ("vanilla", FLOOR, "talks")]
    assert next(r for r in aggregate(same) if r["method"] == "talks")["within_floor"] == "not shown"
    # without a floor run, no pairing
    assert next(r for r in aggregate(OUTCOMES) if r["method"] == "a3")["within_floor"] is None


def test_the_report_shows_the_floor_when_the_run_has_one(tmp_path: Path):
    outs = []
    for i in range(4):
        outs += [_outcome("needle", f"e{i}", "vanilla", 1.0, f"{i}1.", 1.0, 2.0),
                 _outcome("needle", f"e{i}", FLOOR, 1.0, f"{i}1.", 1.0, 2.0),
                 _outcome("needle", f"e{i}", "a3", 0.15, "7." if i == 0 else f"{i}1.", 1.0, 1.0)]
    payload = {**_payload("fidelity", aggregate(outs)), "outcomes": outcome_dicts(outs)}
    md, _ = report.write_result(payload, tmp_path / "fidelity.json")
    text = md.read_text()
    assert "## Against the model's floor" in text
    assert "| needle | a3 | 0.150 | 4 | 0.750 | 0.250–1.00 | 0.250 | 0–0.750 | no |" in text
    # a run without the floor has no such part
    plain = report.write_result(_payload("fidelity", aggregate(OUTCOMES)), tmp_path / "fidelity-old.json")[0]
    assert "model's floor" not in plain.read_text()


def test_aggregate_counts_examples_above_and_below_vanilla():
    rows = {(r["task"], r["method"], r["ratio"]): r for r in aggregate(OUTCOMES)}
    assert (rows[("needle", "a3", 0.15)]["gained_vs_vanilla"], rows[("needle", "a3", 0.15)]["lost_vs_vanilla"]) == (0, 0)
    assert (rows[("musique", "pie", 0.0)]["gained_vs_vanilla"], rows[("musique", "pie", 0.0)]["lost_vs_vanilla"]) == (1, 0)
    assert rows[("needle", "vanilla", 1.0)]["score_vs_vanilla_ci"] is None


def test_paired_interval_is_degenerate_when_the_method_equals_vanilla():
    refs = [1.0, 0.0, 1.0, 1.0, 0.5]
    assert paired_ratio_ci(refs, refs) == (1.0, 1.0)


def test_paired_interval_brackets_the_ratio_and_narrows_with_more_examples():
    # the method loses one example in ten to vanilla
    refs, method = [1.0] * 10, [1.0] * 9 + [0.0]
    lo, hi = paired_ratio_ci(method, refs)
    assert lo < 0.9 < hi <= 1.0
    lo100, hi100 = paired_ratio_ci(method * 10, refs * 10)
    assert lo < lo100 < 0.9 < hi100 < hi
    # seeded: the same data give the same interval
    assert paired_ratio_ci(method, refs) == (lo, hi)


def test_paired_interval_needs_pairs_and_a_vanilla_score():
    assert paired_ratio_ci([1.0], [1.0]) is None
    assert paired_ratio_ci([1.0, 0.0], [0.0, 0.0]) is None


def test_report_from_an_older_file_re_aggregates_its_outcomes(tmp_path: Path):
    old_rows = [{k: v for k, v in r.items() if k not in ("score_vs_vanilla_ci", "gained_vs_vanilla",
                                                           "lost_vs_vanilla")} for r in aggregate(OUTCOMES)]
    more = [_outcome("needle", f"e{i}", m, r, "42", 1.0, 1.0) for i in (2, 3)
            for m, r in (("vanilla", 1.0), ("a3", 0.15))]
    payload = {**_payload("fidelity", old_rows), "outcomes": outcome_dicts(OUTCOMES + more)}
    md, _ = report.write_result(payload, tmp_path / "fidelity.json")
    text = md.read_text()
    assert "## Against vanilla" in text
    # musique comes first; pie scored above vanilla once, where vanilla scored 0 (no ratio, no interval)
    assert "| pie | 0 | –, +1/−0 | – |" in text
    assert "| a3 | 0.150 | – | 1.00 (1.00–1.00), +0/−0 |" in text
    assert "| a3 | 1.00 | – | 1.00, +0/−0 |" in text  # two examples, one with vanilla at 0: no interval


def test_kl_is_zero_for_equal_logits_and_positive_otherwise():
    import torch

    a = torch.tensor([1.0, 2.0, 3.0])
    assert kl_divergence(a, a) == pytest.approx(0.0, abs=1e-12)
    assert kl_divergence(a, torch.tensor([3.0, 2.0, 1.0])) > 0.5


def _speed_rows():
    rows = []
    for ctx in (1024, 2048):
        for m, r, t in (("vanilla", 1.0, 1.0), ("a3", 0.15, 0.3)):
            rows.append({"method": m, "ratio": r, "context_tokens": ctx - 10, "target_context_tokens": ctx,
                         "ttft_s_median": t * ctx / 1024, "ttft_vs_vanilla": t, "ttft_cold_s_median": t * 1.1,
                         "ttft_cold_vs_vanilla": t, "kv_load_s": 0.01, "decode_tok_s": 30.0,
                         "decode_vs_vanilla": 1.0, "peak_rss_mb": 50.0, "peak_rss_vs_vanilla": 1.0})
    return rows


def _payload(kind: str, rows: list[dict]) -> dict:
    return {"kind": kind, "command": f"kvfuse bench {kind} --n 2", "rows": rows, "params": {"repeats": 3},
            "machine": {"cpu_model": "Test CPU", "cpu_cores": 2, "torch_threads": 2, "torch": "2.x",
                        "transformers": "5.x", "python": "3.11"}}


def test_results_render_to_markdown_png_and_readme_block(tmp_path: Path):
    results = tmp_path / "docs" / "results"
    md, png = report.write_result(_payload("fidelity", aggregate(OUTCOMES)), results / "fidelity.json")
    smd, spng = report.write_result(_payload("speed", _speed_rows()), results / "speed.json")
    for p in (png, spng):
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 5000
    text = md.read_text()
    assert "| needle | a3 | 0.150 | 2 | 0.500 |" in text and "kvfuse bench fidelity --n 2" in text
    assert "Test CPU, 2 cores" in text and "![fidelity](fidelity.png)" in text
    assert "| 1014 | vanilla |" in smd.read_text()

    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Results\n{report.README_START}\nold numbers\n{report.README_END}\ntail\n")
    written = report.regenerate(results, readme)
    assert readme in written and results / "index.md" in written
    new = readme.read_text()
    assert "old numbers" not in new and new.endswith(f"{report.README_END}\ntail\n")
    assert "![fidelity](docs/results/fidelity.png)" in new and "![speed](docs/results/speed.png)" in new
    assert "`kvfuse bench speed --n 2`" in new
    # idempotent: a second run changes nothing
    report.regenerate(results, readme)
    assert readme.read_text() == new
    assert json.loads((results / "fidelity.json").read_text())["created"]


def test_readme_without_markers_is_left_alone(tmp_path: Path):
    results = tmp_path / "results"
    report.write_result(_payload("speed", _speed_rows()), results / "speed.json")
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    assert readme not in report.regenerate(results, readme)
    assert readme.read_text() == "# no markers\n"
