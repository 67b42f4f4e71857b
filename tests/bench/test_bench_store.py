"""`kvfuse bench store`: a tiny run produces every number for every KV format, each against float16's, and
the stored size of a corpus per format and model shape."""

from __future__ import annotations

import json

from kvfuse import kv_formats
from kvfuse.bench.store import DTYPES, run_store_bench


def test_tiny_store_bench_reports_every_rate(settings_factory, tmp_path, capsys) -> None:
    out = run_store_bench(settings_factory(), json_out=True, progress=False, chunks=2, tokens=16, repeats=1,
                          scratch=tmp_path, threads=(1, 2))
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(out))
    assert set(out["dtypes"]) == set(DTYPES) == {"float16", "bfloat16", "float32", "fp8", "int8", "int4"}
    for dtype, row in out["dtypes"].items():
        assert row["payload_bytes_per_token"] == kv_formats.payload_bytes(dtype, (30, 3, 16, 64)) // 16
        assert row["bytes_per_token"] > row["payload_bytes_per_token"]  # plus the container header
        for rate in ("write_gbps", "disk_read_gbps", "cold_read_gbps", "hot_read_gbps", "memcpy_gbps",
                     "write_tokens_per_s", "cold_read_tokens_per_s", "cold_read_floats_tokens_per_s"):
            assert row[rate] > 0
        assert row["hot_hits"] == 2 * 3  # lookup + numpy-copy + torch-clone passes: every chunk a hit
        assert [r["threads"] for r in row["reads_by_threads"]] == [1, 2]
        assert all(r["cold_read_gbps"] > 0 and r["warm_read_gbps"] > 0 for r in row["reads_by_threads"])
        assert row["vs_float16"]["bytes_per_token"] == round(row["bytes_per_token"] / out["dtypes"]["float16"]["bytes_per_token"], 3)
    assert out["dtypes"]["float16"]["vs_float16"]["cold_read_tokens_per_s"] == 1.0
    scale = out["scale"]
    assert (scale["llama-3.1-8b"]["layers"], scale["llama-3.1-8b"]["kv_heads"], scale["llama-3.1-8b"]["head_dim"]) == (32, 8, 128)
    f16 = scale["llama-3.1-8b"]["formats"]["float16"]
    assert 128 * 1024 < f16["bytes_per_token"] < 128 * 1024 + 16  # 128 KiB a token, plus the header per 512
    assert scale["default"]["formats"]["int4"]["vs_float16"] <= 0.30
    assert list(tmp_path.iterdir()) == []  # the scratch store is removed
