"""What `kvfuse bench store` derives from its measurements: each format against float16 in the same run,
what a corpus costs at rest per format and model shape, and the table it prints."""

from __future__ import annotations

BASELINE = "float16"
# per format: the rates compared with float16's in the same run (tokens per second, bytes per token)
COMPARED = ("bytes_per_token", "write_tokens_per_s", "disk_read_tokens_per_s", "cold_read_tokens_per_s",
            "cold_read_floats_tokens_per_s", "hot_read_tokens_per_s")


def compare(results: dict[str, dict]) -> None:
    """Each format's `vs_float16`: its rates (and bytes per token) over float16's in the same run."""
    base = results.get(BASELINE)
    for row in results.values():
        row["vs_float16"] = None if base is None else {
            c: (round(row[c] / base[c], 3) if row.get(c) and base.get(c) else None) for c in COMPARED}


def scale(dtypes: tuple[str, ...], shapes: dict[str, tuple[int, int, int]], tokens: int = 512) -> dict:
    """GiB at rest per million corpus tokens, per model shape and format: the blob of one `tokens`-token
    chunk of random KV encoded here (header included), over its tokens."""
    import torch

    from kvfuse import kvblob

    out: dict[str, dict] = {}
    gen = torch.Generator().manual_seed(1)
    for name, (layers, heads, dim) in shapes.items():
        k = torch.randn(layers, heads, tokens, dim, generator=gen)
        v = torch.randn(layers, heads, tokens, dim, generator=gen)
        rows = {}
        for dtype in dtypes:
            blob = kvblob.encode(k, v, model_fingerprint="bench-model", token_ids=list(range(tokens)), dtype=dtype)
            per_token = len(blob) / tokens
            rows[dtype] = {"bytes_per_token": round(per_token, 1), "gib_per_million_tokens": round(per_token * 1e6 / 2**30, 2)}
        base = rows.get(BASELINE)
        for row in rows.values():
            row["vs_float16"] = round(row["bytes_per_token"] / base["bytes_per_token"], 3) if base else None
        out[name] = {"layers": layers, "kv_heads": heads, "head_dim": dim, "formats": rows}
    return out


def print_table(results: dict[str, dict], scales: dict) -> None:
    cols = ("bytes_per_token", "write_tokens_per_s", "disk_read_tokens_per_s", "cold_read_tokens_per_s",
            "cold_read_floats_tokens_per_s", "hot_read_gbps", "memcpy_gbps")
    print("format    " + "  ".join(f"{c[:18]:>18}" for c in cols))
    for dtype, row in results.items():
        print(f"{dtype:<10}" + "  ".join(f"{row[c] or '–':>18}" for c in cols))
    print("\nformat    " + "  ".join(f"{c[:18]:>18}" for c in COMPARED) + "   (over float16's)")
    for dtype, row in results.items():
        print(f"{dtype:<10}" + "  ".join(f"{(row['vs_float16'] or {}).get(c) or '–':>18}" for c in COMPARED))
    print("\nGiB per million tokens")
    for name, sc in scales.items():
        print(f"{name:<14}" + "  ".join(f"{d} {r['gib_per_million_tokens']} ({r['vs_float16']}x)"
                                          for d, r in sc["formats"].items()))
    print("\ndtype     threads   cold GB/s   warm GB/s")
    for dtype, row in results.items():
        for r in row["reads_by_threads"]:
            print(f"{dtype:<10}{r['threads']:>7}{r['cold_read_gbps'] or '–':>12}{r['warm_read_gbps']:>12}")
