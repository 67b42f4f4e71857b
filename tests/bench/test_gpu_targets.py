"""The prepared GPU run (studies/gpu/targets.sh) on a machine without CUDA: the same steps with the tiny
shape, so the script a lent GPU host runs is known to start and finish before one appears. It must write
at most 8 files (what comes back from such a host) and time the engine core's decode."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = {"device.txt", "cuda-tests.txt", "bench.log", "gpu.json", "gpu.md", "gpu.png", "console.txt",
         "store-threads.json"}


@pytest.mark.slow
def test_the_prepared_gpu_run_runs_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    t = time.perf_counter()
    run = subprocess.run(["bash", "studies/gpu/targets.sh", str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    took = time.perf_counter() - t
    assert run.returncode == 0, (run.stdout[-2000:], (out / "console.txt").read_text()[-3000:])
    assert {p.name for p in out.iterdir()} == FILES and len(FILES) <= 8
    payload = json.loads((out / "gpu.json").read_text())
    assert payload["partial"] is False and payload["machine"]["device"] == "cpu"
    assert [s["streams"] for s in payload["streams"]] == [1, 4]
    one = payload["streams"][0]["tokens_per_s"]  # timed warm: b streams give at most b x one stream's
    assert all(s["tokens_per_s"] <= s["streams"] * one for s in payload["streams"])
    assert {s["path"] for s in payload["streams"]} == {"eager"}  # the engine core's runner, as the worker decodes
    assert json.loads((out / "store-threads.json").read_text())
    assert "| streams |" in run.stdout and "skipped" in run.stdout  # the CUDA tests skip here
    print(f"targets.sh on the CPU: {took:.0f} s")
