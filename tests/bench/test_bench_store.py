"""`kvfuse bench store`: a tiny run produces every number for every dtype."""

from __future__ import annotations

import json

from kvfuse.bench.store import run_store_bench


def test_tiny_store_bench_reports_every_rate(settings_factory, tmp_path, capsys) -> None:
    out = run_store_bench(settings_factory(), json_out=True, progress=False, chunks=2, tokens=16, repeats=1,
                          scratch=tmp_path, threads=(1, 2))
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(out))
    assert set(out["dtypes"]) == {"float16", "bfloat16", "float32"}
    for dtype, row in out["dtypes"].items():
        size = 4 if dtype == "float32" else 2
        assert row["payload_bytes_per_token"] == 2 * 30 * 3 * 64 * size
        assert row["bytes_per_token"] > row["payload_bytes_per_token"]  # plus the container header
        for rate in ("write_gbps", "disk_read_gbps", "cold_read_gbps", "hot_read_gbps", "memcpy_gbps"):
            assert row[rate] > 0
        assert row["hot_hits"] == 2 * 3  # lookup + numpy-copy + torch-clone passes: every chunk a hit
        assert [r["threads"] for r in row["reads_by_threads"]] == [1, 2]
        assert all(r["cold_read_gbps"] > 0 and r["warm_read_gbps"] > 0 for r in row["reads_by_threads"])
    assert list(tmp_path.iterdir()) == []  # the scratch store is removed
