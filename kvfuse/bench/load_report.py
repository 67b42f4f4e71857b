"""How a `kvfuse bench load` run is shown: its tables, what batching buys, its plot.

Read by the load benchmark when it writes its result and by `kvfuse bench report` when it re-renders
one, so neither imports the other."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_shadow(rows: list[dict[str, Any]], png: Path) -> Path:
    """A shadow-rate sweep: TTFT p95 and p50 against the rate, one line per method and mode."""
    from kvfuse.bench.plots import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    rates = sorted({r["shadow_rate"] for r in rows})
    for line in dict.fromkeys((r["method"], r["mode"], r["concurrency"]) for r in rows):
        pts = {r["shadow_rate"]: r for r in rows if (r["method"], r["mode"], r["concurrency"]) == line}
        label = f"{line[0]}, {'open loop' if line[1] == 'open' else f'{line[2]} streams'}"
        for ax, key in zip(axes, ("ttft_p95_s", "ttft_p50_s"), strict=True):
            ax.plot(range(len(rates)), [pts[x][key] if x in pts else None for x in rates], marker="o", label=label)
    for ax, title in zip(axes, ("TTFT p95 (s)", "TTFT p50 (s)"), strict=True):
        ax.set_xticks(range(len(rates)), [f"{x:g}" for x in rates])
        ax.set_xlabel("fidelity.shadow_rate")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def plot(rows: list[dict[str, Any]], png: Path) -> Path:
    """Throughput and TTFT p50 against concurrency, one line per method (and shadow rate, when the run
    swept them; closed-loop rows). A sweep of shadow rates at one level: `plot_shadow`."""
    if any("shadow_rate" in r for r in rows) and len({r["concurrency"] for r in rows if r["mode"] == "closed"}) <= 1:
        return plot_shadow(rows, png)
    from kvfuse.bench.plots import pyplot

    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for line in dict.fromkeys(_line(r) for r in rows):
        pts = [r for r in rows if _line(r) == line and r["mode"] == "closed"]
        xs = [r["concurrency"] for r in pts]
        ax1.plot(xs, [r["tokens_per_s"] for r in pts], marker="o", label=line)
        ax2.plot(xs, [r["ttft_p50_s"] for r in pts], marker="o", label=line)
    for ax, title in ((ax1, "generated tokens/s"), (ax2, "TTFT p50 (s)")):
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.set_xscale("log", base=2)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def _line(row: dict[str, Any]) -> str:
    return row["method"] + (f", shadow rate {row['shadow_rate']:g}" if "shadow_rate" in row else "")


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


def table(rows: list[dict[str, Any]]) -> tuple[tuple[str, str], ...]:
    """LOAD_TABLE, led by the shadow rate when the run swept them."""
    return ((("shadow_rate", "shadow rate"),) if any("shadow_rate" in r for r in rows) else ()) + LOAD_TABLE


def first_rate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows measured against the first server of a shadow-rate sweep (all rows when none was swept)."""
    first = rows[0].get("shadow_rate") if rows else None
    return [r for r in rows if r.get("shadow_rate") == first]


def shadow_cost(rows: list[dict[str, Any]], fidelity: dict[str, Any]) -> list[dict[str, Any]]:
    """What shadow checks cost live requests: per method, mode and level, TTFT p95 and p50 at each shadow
    rate over the same at the first rate swept (the baseline, normally 0), and how many checks the server
    had finished by the end of its run (its `GET /v1/fidelity`), so a rate whose checks never ran shows."""
    swept = [r for r in rows if "shadow_rate" in r]
    if not swept:
        return []
    base_rate = swept[0]["shadow_rate"]
    key = lambda r: (r["method"], r["mode"], r["concurrency"])  # noqa: E731
    base = {key(r): r for r in swept if r["shadow_rate"] == base_rate}
    ratio = lambda a, b: round(a / b, 3) if a is not None and b else None  # noqa: E731
    out = []
    for r in swept:
        b = base.get(key(r))
        checks = (fidelity.get(str(r["shadow_rate"]), {}).get("methods", {}).get(r["method"], {}) or {}).get("shadowed")
        out.append({"method": r["method"], "mode": r["mode"], "concurrency": r["concurrency"],
                    "shadow_rate": r["shadow_rate"], "requests": r["requests"], "ttft_p95_s": r["ttft_p95_s"],
                    "ttft_p95_vs_base": ratio(r["ttft_p95_s"], b and b["ttft_p95_s"]),
                    "ttft_p50_vs_base": ratio(r["ttft_p50_s"], b and b["ttft_p50_s"]), "checks": checks})
    return out


SHADOW_TABLE = (("method", "method"), ("mode", "mode"), ("concurrency", "streams"), ("shadow_rate", "shadow rate"),
                ("requests", "requests"), ("ttft_p95_s", "TTFT p95 (s)"), ("ttft_p95_vs_base", "p95 vs first rate"),
                ("ttft_p50_vs_base", "p50 vs first rate"), ("checks", "checks finished (server)"))
