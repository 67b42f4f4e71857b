"""`kvfuse calibrate`'s choice and what it leaves for `serve` (kvfuse/bench/calibrate.py): per method and
bucket the smallest ratio whose Wilson lower end meets the target, written as the controller's hold in
the state file the service loads. The measuring half runs the engine as the shadow checks do and is
exercised end to end in docs/results/contract/ (its command is there)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfuse.bench.calibrate import Cell, choose, read_queries, write_state
from kvfuse.config import load_settings
from kvfuse.service.metrics import Metrics
from kvfuse.service.rag.fidelity import FidelityLedger
from kvfuse.service.rag.fidelity_control import wilson


def run_of(rows: dict[tuple[str, str, float], tuple[int, int]], target: float) -> dict:
    cells = {k: Cell(agreed=[True] * a + [False] * (n - a), kl=[0.1] * n, ttft_s=[0.5] * n)
             for k, (a, n) in rows.items()}
    return {"target": target, "metric": "value", "ratios": sorted({r for _, _, r in rows}), "cells": cells,
            "fingerprint": "fp-cal", "queries": 40, "methods": ["anchor"]}


def test_choose_takes_the_smallest_ratio_whose_lower_end_meets_the_target() -> None:
    run = run_of({("anchor", "0-1024", 0.15): (30, 40), ("anchor", "0-1024", 0.3): (37, 40),
                  ("anchor", "0-1024", 0.5): (40, 40), ("anchor", "1024-4096", 0.15): (20, 40),
                  ("anchor", "1024-4096", 0.3): (25, 40), ("anchor", "1024-4096", 0.5): (30, 40)}, 0.8)
    picks = choose(run)
    assert wilson(37, 40)[0] >= 0.8 > wilson(30, 40)[0]
    assert picks[("anchor", "0-1024")] == {"ratio": 0.3, "checks": 40, "agreements": 37,
                                           "lower": wilson(37, 40)[0], "met": True}
    assert picks[("anchor", "1024-4096")]["ratio"] == 0.5 and not picks[("anchor", "1024-4096")]["met"]


def test_the_choice_is_what_serve_holds(tmp_path: Path) -> None:
    settings = load_settings(data_dir=tmp_path, fidelity={"target_agreement": 0.8})
    run = run_of({("anchor", "0-1024", 0.15): (30, 40), ("anchor", "0-1024", 0.3): (37, 40)}, 0.8)
    write_state(settings, run, choose(run))
    ledger = FidelityLedger(settings, Metrics())
    ledger.attach_model("fp-cal")
    hold = ledger.controller.hold("anchor", "0-1024")
    assert (hold.ratio, hold.checks, hold.agreements) == (0.3, 40, 37)
    fusion = {"method": "anchor"}
    assert ledger.resolve(fusion, 700) == "0-1024" and fusion["recompute_ratio"] == 0.3
    other = FidelityLedger(settings, Metrics())
    other.attach_model("fp-other")  # calibrated for another model: not used
    assert other.controller.ratio("anchor", "0-1024") == other.controller.start


def test_query_file(tmp_path: Path) -> None:
    f = tmp_path / "q.jsonl"
    f.write_text('{"query": "a?", "document_ids": ["x"]}\n\n{"query": "b?"}\n')
    qs = read_queries(f)
    assert [(q.query, q.document_ids) for q in qs] == [("a?", ["x"]), ("b?", None)]
    f.write_text('{"question": "a?"}\n')
    with pytest.raises(ValueError, match="q.jsonl:1"):
        read_queries(f)
