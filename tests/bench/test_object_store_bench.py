"""`kvfuse bench object-store` against a real SeaweedFS and Redis: every client reads back exactly the bytes
written (a wrong or short GET fails the run), one row per client, size and thread count, and nothing is
left under the run's prefix."""

from __future__ import annotations

from kvfuse.bench.object_store import run, table
from kvfuse.config import load_settings
from kvfuse.store.s3_client import open_client


def test_every_client_reads_what_was_written_and_the_run_cleans_up(object_store_settings, redis_url) -> None:
    cfg = load_settings(object_store=object_store_settings).object_store
    result = run(cfg, ["obstore", "boto3"], [65536], objects=4, threads=[1, 2], latency_gets=3, repeats=1,
                 redis_url=redis_url)
    assert set(result["clients"]) == {"obstore", "boto3", "redis"}
    for by_size in result["clients"].values():
        gets = by_size["65536"]["gets"]
        assert set(gets) == {1, 2} and all(g["mb_per_s"] > 0 and g["cpu_s_per_gb"] >= 0 for g in gets.values())
        assert by_size["65536"]["latency_4k"]["p50_ms"] > 0
    assert len(table(result).splitlines()) == 2 + 3 * 2
    assert list(open_client(cfg).keys()) == []  # every object of the run deleted
