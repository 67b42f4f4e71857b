"""`kvfuse bench overload`'s own arithmetic (kvfuse/bench/overload.py), without a server: the RSS bound
the settings set, the p95, the RSS read from /proc, the amplifying DOCX's text, and each target checked
on its own. The flood itself runs in tests/service/api/test_overload_http.py."""

from __future__ import annotations

import os

import psutil

from kvfuse.bench import cli as bench_cli
from kvfuse.bench import overload
from kvfuse.service.rag.files import parse_file

MB = 1024 * 1024


def test_the_rss_bound_is_the_settings_arithmetic() -> None:
    server = {"max_concurrent_requests": 16, "max_body_bytes": MB, "ingest_queue_size": 256,
              "max_document_chars": 65536}
    assert overload.rss_bound_mb(server, 300.0) == 300.0 + 16 * 3 + 1 + 1  # bodies, job records, the document


def test_p95_is_the_nearest_rank_and_rss_is_this_process() -> None:
    assert overload.p95([float(i) for i in range(1, 21)]) == 19.0
    assert overload.p95([3.0, 1.0, 2.0]) == 3.0
    assert abs(overload.rss_mb(os.getpid()) - psutil.Process().memory_info().rss / MB) < 16


def test_the_amplifying_docx_holds_the_text_it_says() -> None:
    data = overload.amplifying_docx(250_000, paragraph=100_000)
    parsed = parse_file(data, "wide.docx", None)
    assert parsed.text.replace("\n", "") == "\u4e2d" * 250_000 and len(data) < 60_000


def test_each_target_fails_on_its_own() -> None:
    good = {"rss_peak_mb": 400.0, "rss_bound_mb": 450.0, "p95_ratio": 1.2, "flood_5xx": 0, "flood_429": 30,
            "burst_answers": {"200": 16, "429 server_busy": 24}, "fair_accepted": 3, "jobs_accepted": 40,
            "jobs_final": {"ready": 40}}
    assert all(overload.targets_met(good).values())
    for change, target in (({"rss_peak_mb": 451.0}, "rss_within_bound"), ({"p95_ratio": 1.6}, "p95_within_ratio"),
                           ({"burst_answers": {"200": 15, "429 server_busy": 24, "503": 1}}, "no_5xx"), ({"flood_429": 0}, "some_429"),
                           ({"fair_accepted": 0}, "fair_key_served"),
                           ({"jobs_final": {"ready": 39, "processing": 1}}, "every_accepted_job_ready")):
        checks = overload.targets_met({**good, **change})
        assert [k for k, ok in checks.items() if not ok] == [target], change


def test_the_command_parses() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="kvfuse")
    bench_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "overload", "--rounds", "2", "--clients", "5"])
    assert (args.rounds, args.clients, args.per_block, args.batch, args.func) == (2, 5, 6, 2, overload.command)


def test_the_ratio_interval_brackets_the_ratio_within_what_resampling_can_reach() -> None:
    import random

    rng = random.Random(1)
    quiet = [10 + rng.random() for _ in range(24)]
    flood = [12 + 2 * rng.random() for _ in range(24)]
    low, high = overload.ratio_interval(quiet, flood)
    assert low <= overload.p95(flood) / overload.p95(quiet) <= high and low < high
    assert overload.ratio_interval(quiet, flood) == [low, high]  # seeded: the same interval again
    assert min(flood) / max(quiet) <= low and high <= max(flood) / min(quiet)  # a resample's p95 is a sample
    assert overload.ratio_interval([1.0] * 5, [2.0] * 5) == [2.0, 2.0]
