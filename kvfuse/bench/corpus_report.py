"""`kvfuse bench corpus`'s summary, table, plot and break-even arithmetic (corpus.py measures).

The arithmetic scales what this run measured to a 100M-token corpus at an 8B shape on a GPU host: reading
a chunk of c tokens from the object store costs one request's latency plus c * bytes-per-token over the
GET bandwidth; recomputing it costs c over the host's prefill rate (`--prefill-tokens-per-s`, the 8B
vanilla prefill `kvfuse bench gpu` measured: docs/results/gpu). Reading pays while the object store's
bandwidth is above c * b / (c / P - latency), the break-even this prints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _rates(result: dict[str, Any]) -> tuple[float, float]:
    """The object store's best measured GET bandwidth (bytes/s) and its small-GET latency p50 (s)."""
    by_size = next(iter(result["object_gets"]["clients"].values()))
    r = next(iter(by_size.values()))
    return max(g["mb_per_s"] for g in r["gets"].values()) * 1e6, r["latency_4k"]["p50_ms"] / 1e3


def hit_rates(run: dict[str, Any]) -> dict[str, float]:
    """Each tier's share of the trace's chunk reads (miss: computed, in no tier)."""
    reads = {t: n for t, n in run["tiers"]["reads"].items() if n}
    total = sum(reads.values())
    return {t: round(n / total, 3) for t, n in sorted(reads.items())} if total else {}


def answers_agree(a: list[str], b: list[str]) -> dict[str, Any]:
    """How many of the same queries' answers are equal (the issue's target: at the default ratio the
    tiered server answers as the same server with no budget does), and which differ (trace positions)."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} answers against {len(b)}: not the same queries")
    differ = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    return {"equal": len(a) - len(differ), "of": len(a), "differ": differ}


def block_ratios(blocks: list[dict[str, Any]], num: str, den: str) -> dict[str, Any]:
    """Per block, arm `num`'s TTFT p50 over arm `den`'s on the same queries (corpus_arms.schedule runs every
    arm on each block within minutes of the others): the spread of the ratio as the host's load drifted."""
    from statistics import median

    p50 = {(b["block"], b["arm"]): b["ttft_p50_ms"] for b in blocks}
    ratios = [round(p50[(n, num)] / p50[(n, den)], 3) for n in sorted({b["block"] for b in blocks})
              if (n, num) in p50 and p50.get((n, den))]
    if not ratios:
        return {"blocks": 0, "ratios": []}
    return {"blocks": len(ratios), "min": min(ratios), "median": round(median(ratios), 3), "max": max(ratios),
            "ratios": ratios}


def break_even(result: dict[str, Any]) -> dict[str, float]:
    p = result["params"]
    bw, lat = _rates(result)
    local = result["local"]
    c = local["tokens"] / max(1, local["chunks"])  # mean chunk tokens of this corpus
    b, rate = p["bytes_per_token_8b"], p["prefill_tokens_per_s"]
    compute_s, read_s = c / rate, lat + c * b / bw
    spare = compute_s - lat
    # this host's precompute, document context included: every server's tokens over the wall time of their
    # ingestions, which ran at once (corpus.ingest_both)
    phases = [result[n] for n in ("local", "tiered") if n in result]
    host_rate = sum(p["tokens"] for p in phases) / max(p["ingest_s"] for p in phases)
    host_bpt = result["kv_bytes"] / max(1, local["tokens"])  # the default model's KV at rest, per token
    return {"host_tokens_per_s": round(host_rate, 1), "host_kv_bytes_per_token": round(host_bpt),
            "host_tb_100m": round(100e6 * host_bpt / 1e12, 2), "host_precompute_days_100m": round(
                100e6 / host_rate / 86400, 1),
            "chunk_tokens": round(c, 1), "chunk_mb_8b": round(c * b / 1e6, 2), "read_ms": round(1e3 * read_s, 2),
            "compute_ms": round(1e3 * compute_s, 2), "read_over_compute": round(read_s / compute_s, 3),
            "break_even_mb_per_s": round(c * b / spare / 1e6, 1) if spare > 0 else None,
            "measured_mb_per_s": round(bw / 1e6, 1), "latency_ms": round(1e3 * lat, 2),
            "corpus_tb_100m": round(100e6 * b / 1e12, 2), "precompute_h_100m": round(100e6 / rate / 3600, 2)}


def summary(result: dict[str, Any]) -> dict[str, Any]:
    local, tiered = result["local"], result["tiered"]
    lo, va, ti = local["runs"]["default"], local["runs"]["vanilla"], tiered["runs"]["default"]
    touched = {d for q in local["trace"] for d in q}
    return {
        "documents": local["documents"], "chunks": local["chunks"], "tokens": local["tokens"],
        "kv_mb": round(result["kv_bytes"] / 2**20, 1), "budget_mb": result["budget_mb"],
        "corpus_over_budget": round(result["kv_bytes"] / 2**20 / result["budget_mb"], 1),
        "documents_touched": len(touched), "queries": lo["queries"],
        "ingest_s": {"local": local["ingest_s"], "tiered": tiered["ingest_s"],
                     "ratio": round(tiered["ingest_s"] / local["ingest_s"], 3)},
        "ttft_ms": {"local": [lo["ttft_p50_ms"], lo["ttft_p99_ms"]], "tiered": [ti["ttft_p50_ms"], ti["ttft_p99_ms"]],
                    "vanilla": [va["ttft_p50_ms"], va["ttft_p99_ms"]]},
        "tiered_over_local_p50": round(ti["ttft_p50_ms"] / lo["ttft_p50_ms"], 3),
        "tiered_over_vanilla_p50": round(ti["ttft_p50_ms"] / va["ttft_p50_ms"], 3),
        "per_block": {"tiered_over_local": block_ratios(result["blocks"], "tiered", "local"),
                      "tiered_over_vanilla": block_ratios(result["blocks"], "tiered", "vanilla")},
        "planned_over_stored_kv": round(result["planned_kv_bytes"] / result["kv_bytes"], 3),
        "load_avg_1m": result["load_avg_1m"],
        "hit_rate": {"local": hit_rates(lo), "tiered": hit_rates(ti)},
        "chunks_computed": {"local": lo["chunks_computed"], "tiered": ti["chunks_computed"]},
        "answers_equal": {"tiered_vs_local": answers_agree(ti["answers"], lo["answers"]),
                          "vanilla_vs_local": answers_agree(va["answers"], lo["answers"])},
        "bytes_mb": {name: {t: round(v / 2**20, 1) for t, v in ph["runs"]["default"]["tiers"]["bytes"].items()}
                     for name, ph in (("local", local), ("tiered", tiered))},
        "lmdb_file_mb": {"local": local["lmdb_file_mb"], "tiered": tiered["lmdb_file_mb"]},
        "evictions": tiered["runs"]["default"]["tiers"]["evictions"],
        "break_even": break_even(result),
    }


def _spread(r: dict[str, Any]) -> str:
    if not r.get("blocks"):
        return "(no blocks)"
    return f"median {r['median']}x, {r['min']}-{r['max']}x over {r['blocks']} blocks"


def render(result: dict[str, Any]) -> str:
    s = result["summary"]
    t, h, be, eq = s["ttft_ms"], s["hit_rate"], s["break_even"], s["answers_equal"]
    fmt = lambda d: ", ".join(f"{k} {v}" for k, v in d.items()) or "-"  # noqa: E731
    lines = [
        "# A corpus ten times the LMDB budget, on an object store", "", f"Command: `{result['command']}`", "",
        f"{s['documents']} documents, {s['chunks']} chunks, {s['tokens']} tokens, {s['kv_mb']} MB of KV; LMDB "
        f"budget {s['budget_mb']} MB ({s['corpus_over_budget']}x smaller). {s['queries']} queries, "
        f"{s['documents_touched']} documents touched. Run took {result['seconds']} s.", "",
        "| | local (no budget) | tiered (budget + object store) | vanilla |", "|---|---|---|---|",
        f"| ingest s (both at once) | {s['ingest_s']['local']} | {s['ingest_s']['tiered']} | - |",
        f"| TTFT p50 ms | {t['local'][0]} | {t['tiered'][0]} | {t['vanilla'][0]} |",
        f"| TTFT p99 ms | {t['local'][1]} | {t['tiered'][1]} | {t['vanilla'][1]} |",
        f"| reads per tier (share of chunk reads) | {fmt(h['local'])} | {fmt(h['tiered'])} | - |",
        f"| chunks computed in the trace | {s['chunks_computed']['local']} | {s['chunks_computed']['tiered']} | - |",
        f"| MB per tier after the trace | {fmt(s['bytes_mb']['local'])} | {fmt(s['bytes_mb']['tiered'])} | - |",
        f"| LMDB file MB | {s['lmdb_file_mb']['local']} | {s['lmdb_file_mb']['tiered']} | - |",
        f"| evictions in the trace | - | {fmt(s['evictions'])} | - |",
        f"| answers equal to local's ({result['params']['max_tokens']} greedy tokens) | - | "
        f"{eq['tiered_vs_local']['equal']}/{eq['tiered_vs_local']['of']} | "
        f"{eq['vanilla_vs_local']['equal']}/{eq['vanilla_vs_local']['of']} |", "",
        f"Tiered over local TTFT p50: **{s['tiered_over_local_p50']}x** (target <= 1.5x); per block of "
        f"{result['params']['block']} queries {_spread(s['per_block']['tiered_over_local'])}. Tiered over vanilla: "
        f"{s['tiered_over_vanilla_p50']}x (per block {_spread(s['per_block']['tiered_over_vanilla'])}).", "",
        f"Both servers up at once; both ingested at once (each ingest time taken with the other beside it); the "
        f"arms took turns a block at a time. Load average (1 min): {fmt(s['load_avg_1m'])}. The budget was planned "
        f"from the documents' tokens at {s['planned_over_stored_kv']}x the KV then stored.", "",
        "## 100M tokens at an 8B shape on a GPU host", "",
        f"Object store GETs measured here: {be['measured_mb_per_s']} MB/s (best of the thread counts), "
        f"{be['latency_ms']} ms per small GET. A mean chunk of {be['chunk_tokens']} tokens is "
        f"{be['chunk_mb_8b']} MB at 8B int8: read {be['read_ms']} ms, recompute {be['compute_ms']} ms at "
        f"{result['params']['prefill_tokens_per_s']:.0f} tokens/s ({be['read_over_compute']}x). Reading breaks "
        f"even at {be['break_even_mb_per_s']} MB/s per host. 100M tokens: {be['corpus_tb_100m']} TB of KV; "
        f"precomputing it all takes {be['precompute_h_100m']} h of one such GPU. This host measured "
        f"{be['host_tokens_per_s']} tokens/s of precompute (both servers' ingestions at once, document context included) and {be['host_kv_bytes_per_token']} "
        f"bytes of the default model's KV per token: 100M tokens would be {be['host_tb_100m']} TB and "
        f"{be['host_precompute_days_100m']} days of precompute here.", "",
    ]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    from kvfuse.bench.plots import pyplot

    plt = pyplot()
    s = result["summary"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.8))
    runs = {"local": result["local"]["runs"]["default"], "tiered": result["tiered"]["runs"]["default"],
            "vanilla": result["local"]["runs"]["vanilla"]}
    colors = {"local": "tab:blue", "tiered": "tab:orange", "vanilla": "tab:gray"}
    for name, r in runs.items():
        xs = sorted(r["ttft_ms"])
        a.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name, color=colors[name])
    a.set_xlabel("TTFT ms")
    a.set_ylabel("share of queries")
    a.set_title(f"TTFT over the trace ({s['queries']} queries)")
    a.legend()
    a.grid(alpha=0.3)
    tiers = sorted({t for v in s["hit_rate"].values() for t in v})
    tier_colors = dict(zip(tiers, ("tab:green", "tab:purple", "tab:red", "tab:brown", "tab:olive"), strict=False))
    for t in tiers:  # one color per tier, stacked in the same order on both bars
        bottoms = [sum(s["hit_rate"][n].get(u, 0.0) for u in tiers[:tiers.index(t)]) for n in ("local", "tiered")]
        b.bar([0, 1], [s["hit_rate"][n].get(t, 0.0) for n in ("local", "tiered")], bottom=bottoms, label=t,
              color=tier_colors.get(t))
    b.set_xticks([0, 1], ["local", "tiered"])
    b.set_ylabel("share of chunk reads")
    b.set_title("reads per tier")
    b.legend(fontsize=8)
    for name in runs:  # each arm's p50 per block: the load's drift, landing on every arm alike
        pts = sorted((bl["block"], bl["ttft_p50_ms"]) for bl in result["blocks"] if bl["arm"] == name)
        c.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name, color=colors[name])
    c.set_xlabel("block (arms in turn)")
    c.set_ylabel("TTFT p50 ms")
    c.set_title(f"per block of {result['params']['block']} queries")
    c.legend(fontsize=8)
    c.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
