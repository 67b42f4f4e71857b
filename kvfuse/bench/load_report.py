"""How a `kvfuse bench load` run is shown: its tables, what batching buys, its plot.

Read by the load benchmark when it writes its result and by `kvfuse bench report` when it re-renders
one, so neither imports the other."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(rows: list[dict[str, Any]], png: Path) -> Path:
    """Throughput and TTFT p50 against concurrency, one line per method (closed-loop rows)."""
    from kvfuse.bench.plots import pyplot

    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        pts = [r for r in rows if r["method"] == method and r["mode"] == "closed"]
        xs = [r["concurrency"] for r in pts]
        ax1.plot(xs, [r["tokens_per_s"] for r in pts], marker="o", label=method)
        ax2.plot(xs, [r["ttft_p50_s"] for r in pts], marker="o", label=method)
    for ax, title in ((ax1, "generated tokens/s"), (ax2, "TTFT p50 (s)")):
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.set_xscale("log", base=2)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


LOAD_TABLE = (("method", "method"), ("mode", "mode"), ("concurrency", "streams"), ("requests", "requests"),
              ("errors", "errors"), ("ttft_p50_s", "TTFT p50 (s)"), ("ttft_p95_s", "TTFT p95 (s)"),
              ("itl_p50_s", "ITL p50 (s)"), ("itl_p95_s", "ITL p95 (s)"), ("tpot_p50_s", "TPOT p50 (s)"),
              ("tokens_per_s", "tokens/s"), ("requests_per_s", "requests/s"), ("served_by", "served by"))


def scaling(rows: list[dict[str, Any]], at: int | None = None) -> list[dict[str, Any]]:
    """Per method, what batching buys: closed-loop tokens/s and ITL p50 at `at` streams (the most the
    run measured, unless given) over 1 stream, and requests/s at `at` streams over vanilla's."""
    closed = {(r["method"], r["concurrency"]): r for r in rows if r["mode"] == "closed"}
    if at is None:
        at = max((c for _, c in closed), default=1)
    ratio = lambda a, b: round(a / b, 3) if a is not None and b else None  # noqa: E731
    out = []
    for method in dict.fromkeys(m for m, _ in closed):
        one, many, van = closed.get((method, 1)), closed.get((method, at)), closed.get(("vanilla", at))
        if one is None or many is None:
            continue
        out.append({"method": method, "streams": at,
                    "tokens_per_s_vs_1": ratio(many["tokens_per_s"], one["tokens_per_s"]),
                    "itl_p50_vs_1": ratio(many["itl_p50_s"], one["itl_p50_s"]),
                    "tpot_p50_vs_1": ratio(many.get("tpot_p50_s"), one.get("tpot_p50_s")),
                    "requests_per_s_vs_vanilla": ratio(many["requests_per_s"], van and van["requests_per_s"])})
    return out


SCALING_TABLE = (("method", "method"), ("streams", "streams"), ("tokens_per_s_vs_1", "tokens/s vs 1 stream"),
                 ("itl_p50_vs_1", "ITL p50 vs 1 stream"), ("tpot_p50_vs_1", "TPOT p50 vs 1 stream"),
                 ("requests_per_s_vs_vanilla", "requests/s vs vanilla"))
