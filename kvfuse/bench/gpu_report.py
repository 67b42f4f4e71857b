"""The tables and plot of `kvfuse bench gpu` (kvfuse/bench/gpu.py), written beside its JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvfuse.bench.plots import _colors, method_key, pyplot


def write_json(payload: dict[str, Any], path: Path) -> None:
    """Atomically (a run cut short leaves the last whole file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _f(x: Any, spec: str = ".3f") -> str:
    return "–" if x is None else format(x, spec)


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| context | method | TTFT s | × vanilla | from LMDB s | × vanilla | read s | full layers s | select s "
            "| recompute s | KV copy s | copy hidden | recomputed | peak MB | × vanilla | decode tok/s | × vanilla |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in sorted(rows, key=lambda r: (r["context_tokens"], method_key(r["method"]))):
        sp = r["split"]
        lines.append(
            f"| {r['context_tokens']} | {r['method']} | {_f(r['ttft_s'])} | {_f(r['ttft_s_vs_vanilla'], '.2f')} "
            f"| {_f(r['ttft_lmdb_s'])} | {_f(r['ttft_lmdb_s_vs_vanilla'], '.2f')} | {_f(r['read_s'])} "
            f"| {_f(sp.get('full_layers_s'))} | {_f(sp.get('select_s'))} | {_f(sp.get('recompute_s'))} "
            f"| {_f(sp.get('kv_copy_s'))} | {_f(r['kv_copy_hidden_share'], '.0%')} | {r['recomputed_tokens']} "
            f"| {_f(r['peak_prefill_mb'], '.0f')} | {_f(r['peak_prefill_mb_vs_vanilla'], '.2f')} "
            f"| {_f(r['decode_tok_s'], '.1f')} | {_f(r['decode_tok_s_vs_vanilla'], '.2f')} |")
    return "\n".join(lines)


def streams_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| streams | context | tokens/s | × one stream |", "|---|---|---|---|"]
    lines += [f"| {r['streams']} | {r['context_tokens']} | {r['tokens_per_s']:.1f} | {r['vs_one_stream']:.2f} |"
              for r in rows]
    return "\n".join(lines)


def summary(payload: dict[str, Any]) -> str:
    """The short table the targets read: TTFT as a share of vanilla's with the KV in host RAM, on the
    device and from LMDB, the sparse path against the dense mask, decode; then the streams."""
    lines = ["| context | method | TTFT s | × vanilla (RAM) | × vanilla (device KV) | × vanilla (LMDB) "
             "| × dense mask | first call s | decode tok/s |", "|" + "---|" * 9]
    for r in sorted(payload["rows"], key=lambda r: (r["context_tokens"], method_key(r["method"]))):
        lines.append(
            f"| {r['context_tokens']} | {r['method']} | {_f(r['ttft_s'])} | {_f(r['ttft_s_vs_vanilla'], '.2f')} "
            f"| {_f(r.get('ttft_device_kv_s_vs_vanilla'), '.2f')} | {_f(r['ttft_lmdb_s_vs_vanilla'], '.2f')} "
            f"| {_f(r.get('ttft_s_vs_dense_mask'), '.2f')} | {_f(r.get('first_ttft_s'))} "
            f"| {_f(r['decode_tok_s'], '.1f')} |")
    out = "\n".join(lines)
    if payload.get("streams"):
        out += "\n\n" + streams_table(payload["streams"])
    return out


def plot(payload: dict[str, Any], path: Path) -> Path:
    """TTFT against context per method (log-log), and TTFT as a share of vanilla's."""
    plt = pyplot()
    rows = payload["rows"]
    methods = sorted({r["method"] for r in rows}, key=method_key)
    colors = _colors(methods)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for m in methods:
        rs = sorted((r for r in rows if r["method"] == m), key=lambda r: r["context_tokens"])
        x = [r["context_tokens"] for r in rs]
        a.plot(x, [r["ttft_s"] for r in rs], "o-", color=colors[m], label=m)
        b.plot(x, [r["ttft_s_vs_vanilla"] for r in rs], "o-", color=colors[m], label=m)
    a.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="TTFT (s), KV in host RAM")
    b.set(xscale="log", xlabel="context tokens", ylabel="TTFT / vanilla TTFT")
    b.axhline(1.0, color="grey", lw=0.5)
    a.legend(fontsize=7)
    p = payload["params"]
    fig.suptitle(f"{payload['machine'].get('device')} · {p['shape']} {p['dtype']} · r = {p['ratio']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render(payload: dict[str, Any], json_path: Path) -> str:
    """Write the .md (and .png when matplotlib is there) beside the JSON; returns the markdown."""
    md = f"`{payload['command']}` on {payload['machine'].get('device')}\n\n{table(payload['rows'])}\n"
    if payload.get("streams"):
        md += f"\n{streams_table(payload['streams'])}\n"
    json_path.with_suffix(".md").write_text(md, encoding="utf-8")
    try:
        plot(payload, json_path.with_suffix(".png"))
    except ModuleNotFoundError:
        pass
    return md
