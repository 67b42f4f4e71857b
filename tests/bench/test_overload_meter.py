"""`kvfuse bench overload`'s meter and refusal costs (kvfuse/bench/overload_meter.py, overload_costs.py)
without a server: CPU seconds read from /proc against the kernel's own count, the children of a process
and their roles, histogram deltas between two /metrics readings, the per-phase summary, the margin's
arithmetic, and the API's loop-lag watcher (kvfuse/service/loop_lag.py) seeing a blocked loop."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections import Counter

from prometheus_client import CollectorRegistry, Histogram

from kvfuse.bench.overload_costs import margin
from kvfuse.bench.overload_meter import (
    Block,
    children,
    cpu_delta,
    cpu_s,
    histogram_delta,
    plot,
    role,
    summarize_blocks,
)
from kvfuse.service.loop_lag import watch_loop_lag


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_cpu_seconds_are_the_kernels_count_of_this_process() -> None:
    before, mine = cpu_s(os.getpid()), os.times()
    _spin(0.3)
    after, now = cpu_s(os.getpid()), os.times()
    kernel = (now.user + now.system) - (mine.user + mine.system)
    assert abs((after - before) - kernel) < 0.05 and after - before > 0.25
    assert cpu_s(2 ** 22 + 7) == 0.0  # no such process: nothing, not an error


def test_children_are_found_and_named_by_their_command_line() -> None:
    code = "import time; time.sleep(30)  # parse_worker"
    with subprocess.Popen([sys.executable, "-c", code]) as child:
        try:
            assert child.pid in children(os.getpid())
            assert role(child.pid) == "parse"
        finally:
            child.kill()
    assert role(os.getpid()) == "other"


def test_cpu_delta_sums_each_role_and_counts_a_new_process_from_zero() -> None:
    before = {1: ("api", 10.0), 2: ("worker", 100.0), 3: ("parse", 5.0)}
    after = {1: ("api", 12.5), 2: ("worker", 104.0), 3: ("parse", 5.5), 4: ("parse", 0.75), 5: ("other", 9.0)}
    assert cpu_delta(before, after) == {"api": 2.5, "worker": 4.0, "parse": 1.25}


def _histogram_text(observations: list[float]) -> dict[str, float]:
    registry = CollectorRegistry()
    h = Histogram("kvfuse_event_loop_lag_seconds", "lag", buckets=(0.01, 0.1, 1.0), registry=registry)
    for x in observations:
        h.observe(x)
    return {f"kvfuse_event_loop_lag_seconds|{labels}|{part}": value
            for metric in registry.collect() for s in metric.samples
            for part in [s.name.rsplit("_", 1)[1]] if part in ("sum", "count", "bucket")
            for labels in [",".join(f'{k}="{v}"' for k, v in s.labels.items())]
            for value in [s.value]}


def test_a_histogram_delta_is_the_observations_between_two_readings() -> None:
    before = _histogram_text([0.005] * 10)
    after = _histogram_text([0.005] * 10 + [0.005] * 98 + [0.05, 0.5])  # 100 more: 98 small, 2 larger
    d = histogram_delta(before, after, "kvfuse_event_loop_lag_seconds")
    assert d["n"] == 100 and abs(d["sum_s"] - (98 * 0.005 + 0.55)) < 1e-3
    assert abs(d["mean_s"] - d["sum_s"] / 100) < 1e-5
    assert d["p99_le_s"] == 0.1  # 99 of 100 are at or under 0.1 s, 98 under 0.01
    assert histogram_delta(after, after, "kvfuse_event_loop_lag_seconds")["mean_s"] is None


def test_the_summary_is_cores_per_phase_and_the_mean_query_parts() -> None:
    steps = {"query": {"n": 10, "sum_s": 1.0}, "ingest": {"n": 0, "sum_s": 0.0}}
    lag = {"n": 100, "sum_s": 0.5, "p99_le_s": 0.025}
    quiet = Block("quiet", wall_s=10.0, cpu_s={"api": 1.0, "worker": 8.0, "parse": 0.0, "flood_clients": 0.0},
                  steps=steps, loop_lag=lag, load=(2.0, 3.0), queries_s=[1.0, 2.0],
                  timings=[{"total_ms": 900.0, "queue_ms": 10.0}, {"total_ms": 1900.0, "queue_ms": 30.0}])
    flood = Block("flood", wall_s=20.0, cpu_s={"api": 6.0, "worker": 18.0, "parse": 2.0, "flood_clients": 4.0},
                  steps={"query": {"n": 10, "sum_s": 2.0}, "ingest": {"n": 30, "sum_s": 9.0}},
                  loop_lag={"n": 200, "sum_s": 4.0, "p99_le_s": 0.25}, flood_requests=400, load=(3.0, 5.0),
                  queries_s=[3.0], timings=[{"total_ms": 2500.0, "queue_ms": 500.0}])
    s = summarize_blocks([quiet, flood])
    assert s["quiet"]["cores"] == {"api": 0.1, "worker": 0.8, "parse": 0.0, "flood_clients": 0.0}
    assert s["flood"]["cores"] == {"api": 0.3, "worker": 0.9, "parse": 0.1, "flood_clients": 0.2}
    assert s["flood"]["steps"]["ingest"] == {"n": 30, "mean_s": 0.3, "per_s": 1.5, "busy_share": 0.45}
    assert s["quiet"]["loop_lag_mean_s"] == 0.005 and s["flood"]["loop_lag_p99_le_s"] == 0.25
    assert s["quiet"]["query_parts_mean_ms"]["queue_ms"] == 20.0
    assert s["quiet"]["client_over_server_ms"] == 100.0  # 1.5 s on the client, 1.4 s on the server
    assert s["flood"]["flood_requests_per_s"] == 20.0 and s["flood"]["load"] == [3.0, 5.0]


def test_the_margin_counts_only_what_the_extra_thread_added() -> None:
    refusal = (429, "ingest_queue_full")
    base = {"wall_s": 5.0, "api_cpu_s": 1.0, "client_cpu_s": 0.5,
            "answers": Counter({("batch", 202, ""): 5, ("batch", 429, "ingest_queue_full"): 100})}
    more = {"wall_s": 10.0, "api_cpu_s": 3.0, "client_cpu_s": 1.6,
            "answers": Counter({("batch", 202, ""): 10, ("batch", 429, "ingest_queue_full"): 600})}
    m = margin(base, more, refusal)
    # twice the base's rates over twice its time: 2.0 s of the API, 200 refusals; the margin: 1.0 s / 400
    assert m["refusals_at_margin"] == 400 and m["api_cpu_ms_per_refusal"] == 2.5
    assert m["client_cpu_ms_per_refusal"] == 1.5
    assert m["answers_with_margin"] == {"batch 202": 10, "batch 429 ingest_queue_full": 600}
    assert margin(base, base, refusal)["api_cpu_ms_per_refusal"] is None  # nothing at the margin


def test_the_loop_lag_watcher_sees_a_blocked_loop() -> None:
    registry = CollectorRegistry()
    lag = Histogram("lag_seconds", "lag", buckets=(0.01, 0.1, 1.0), registry=registry)

    async def main() -> None:
        task = asyncio.create_task(watch_loop_lag(lag, every_s=0.02))
        await asyncio.sleep(0.1)
        time.sleep(0.3)  # holds the loop: the timer due meanwhile runs about 0.3 s late
        await asyncio.sleep(0.1)
        task.cancel()

    asyncio.run(main())
    count, late = registry.get_sample_value("lag_seconds_count"), registry.get_sample_value("lag_seconds_sum")
    assert count >= 5 and late >= 0.25
    assert count - registry.get_sample_value("lag_seconds_bucket", {"le": "0.1"}) >= 1  # the one held


def test_the_plot_is_drawn_from_a_result_file(tmp_path) -> None:
    block = {"phase": "quiet", "queries_s": [1.0, 1.2]}
    cores = {"api": 0.1, "worker": 0.8, "parse": 0.0, "flood_clients": 0.0}
    payload = {"command": "kvfuse bench overload", "machine": {"cpu_cores": 2},
               "result": {"blocks": [block, {**block, "phase": "flood", "queries_s": [1.5, 2.0]}],
                          "p95_quiet_s": 1.2, "p95_flood_s": 2.0, "p95_ratio": 1.667,
                          "where_time_went": {"quiet": {"cores": cores}, "flood": {"cores": {**cores, "api": 0.4}}}}}
    path = plot(payload, tmp_path / "overload.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
