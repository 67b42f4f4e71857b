"""Plots of benchmark results (PNG, via matplotlib).

matplotlib is an optional extra (`pip install 'kvfuse[bench]'`; `make setup` installs it): it is imported
only when a plot is drawn, so the service never loads it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Drawing order and colours: one per method, stable across plots (tables list methods in this order too).
METHOD_ORDER = ("vanilla", "full_reuse", "pie", "epic", "cacheblend", "a3", "prophetkv", "anchor")
MISSING_MATPLOTLIB = "plotting needs matplotlib, the optional extra `bench`: pip install 'kvfuse[bench]'"


def method_key(method: str) -> tuple[int, str]:
    return (METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER), method)


def plot_if_possible(draw: Callable[[Any, Path], Any], result: Any, path: Path) -> Any:
    """`draw(result, path)`, or None with the reason on stderr when matplotlib is missing: a bench's
    JSON and table are written either way."""
    try:
        return draw(result, path)
    except ModuleNotFoundError as err:
        print(f"no plot: {err}", file=sys.stderr)
        return None


def pyplot() -> Any:
    """matplotlib.pyplot (headless), or ModuleNotFoundError naming the extra to install."""
    try:
        import matplotlib
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(MISSING_MATPLOTLIB, name="matplotlib") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colors(methods: Sequence[str]) -> dict[str, Any]:
    plt = pyplot()
    cmap = plt.get_cmap("tab10")
    return {m: cmap(method_key(m)[0] % 10) for m in methods}


def plot_fidelity(rows: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Score vs recompute ratio, one line per method, one panel per task; fixed-ratio methods (vanilla,
    no recompute) are drawn as horizontal dashed lines across the panel."""
    plt = pyplot()
    tasks = sorted({r["task"] for r in rows})
    methods = sorted({r["method"] for r in rows}, key=method_key)
    colors = _colors(methods)
    fig, axes = plt.subplots(1, len(tasks), figsize=(max(3.6 * len(tasks), 8.0), 3.8), squeeze=False,
                             sharey=True)
    for ax, task in zip(axes[0], tasks, strict=True):
        for m in methods:
            pts = sorted((r["ratio"], r["score"]) for r in rows if r["task"] == task and r["method"] == m)
            if not pts:
                continue
            if len(pts) == 1:
                ax.axhline(pts[0][1], color=colors[m], ls="--", lw=1.2, label=f"{m} (r={pts[0][0]:g})")
            else:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colors[m], label=m)
        n = max((r["n"] for r in rows if r["task"] == task), default=0)
        ax.set_title(f"{task} (n={n})")
        ax.set_xlabel("recompute ratio")
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("score (exact match / F1)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    ncol = min(len(labels), 5)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    legend_rows = -(-len(labels) // ncol) if labels else 0
    fig.tight_layout(rect=(0, 0.06 * legend_rows + 0.02, 1, 0.95 if title else 1))
    return _save(plt, fig, path)


def plot_speed(rows: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path:
    """TTFT vs context length per method (log-y): KV warm in memory, and cold from LMDB."""
    plt = pyplot()
    methods = sorted({r["method"] for r in rows}, key=method_key)
    colors = _colors(methods)
    panels = [("ttft_s_median", "TTFT, KV in memory (s)")]
    if any(r.get("ttft_cold_s_median") is not None for r in rows):
        panels.append(("ttft_cold_s_median", "TTFT, KV from LMDB (s)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False, sharey=True)
    for ax, (key, label) in zip(axes[0], panels, strict=True):
        for m in methods:
            pts = sorted((r["context_tokens"], r[key]) for r in rows if r["method"] == m and r.get(key))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colors[m], label=m)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = sorted({r["context_tokens"] for r in rows})
        ax.set_xticks(ticks, [f"{t / 1024:.1f}k" for t in ticks])
        ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.set_xlabel("context tokens")
        ax.set_title(label)
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("seconds")
    axes[0][-1].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
