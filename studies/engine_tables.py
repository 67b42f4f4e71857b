"""The decode table and plot of the engine study (docs/results/engine/README.md) from `kvfuse bench decode
--json` files of the code before and after, run in turn on one machine.

    python studies/engine_tables.py BEFORE.json AFTER.json [BEFORE.json AFTER.json ...] [--plot OUT.png]

Per run pair and stream count: each path's step time, its ratio to the weight-read bound measured in the
same run (the model's weight bytes over measured memcpy bandwidth: what one decode step cannot beat), and
tokens/s against one stream.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(path: str) -> tuple[dict, list[dict]]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return data, data["rows"]


def table(pairs: list[tuple[str, str]]) -> list[str]:
    out = ["| run | code | path | streams | step (ms) | step / bound | tokens/s | tokens/s vs 1 stream |",
           "|---|---|---|---|---|---|---|---|"]
    for i, (before, after) in enumerate(pairs, 1):
        for label, path in (("before", before), ("after", after)):
            data, rs = rows(path)
            for r in rs:
                out.append(f"| {i} | {label} ({data['machine']['git_commit']}) | {r['path']} | {r['streams']} "
                           f"| {r['step_ms']:.1f} | {r['step_vs_bound']:.2f} | {r['tok_s']:.1f} "
                           f"| {r['tok_s_vs_one_stream']:.2f} |")
    return out


def plot(pairs: list[tuple[str, str]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(pairs), figsize=(5 * len(pairs), 3.6), sharey=True, squeeze=False)
    for ax, (i, (before, after)) in zip(axes[0], enumerate(pairs, 1), strict=True):
        series = {}
        for label, path in (("before", before), ("after", after)):
            data, rs = rows(path)
            for r in rs:
                series.setdefault(f"{label}: {r['path']}", []).append((r["streams"], r["step_vs_bound"]))
        for name, pts in series.items():
            ax.plot(*zip(*pts, strict=True), marker="o", label=name)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_title(f"run {i}")
        ax.set_xlabel("streams decoding together")
    axes[0][0].set_ylabel("step time / weight-read bound")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str]) -> int:
    out = Path(argv[argv.index("--plot") + 1]) if "--plot" in argv else None
    paths = [a for a in argv if a.endswith(".json")]
    if not paths or len(paths) % 2:
        print(__doc__, file=sys.stderr)
        return 2
    pairs = list(zip(paths[::2], paths[1::2], strict=True))
    print("\n".join(table(pairs)))
    if out is not None:
        plot(pairs, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
