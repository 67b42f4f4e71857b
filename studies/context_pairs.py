"""A precompute context against `none`, example by example, for one method (context_modes.py's output).

    python studies/context_pairs.py METHOD LABEL=PREFIX [LABEL=PREFIX ...] [--png PATH]

Each PREFIX names a context_modes.py run: PREFIX-none.json and one PREFIX-<mode>.json, the same examples
computed both ways. Per run and task, and over all tasks: the pairs, in how many the mode's answer KL to
vanilla is lower, the two-sided sign test, the ratio of mean answer KL (mode / none) with its 95 % paired
bootstrap interval (kvfuse.bench.agreement.paired_ratio_ci), and how many answers equal vanilla's in
each mode. Prints a markdown table; with --png, also plots each example's answer KL with the context
against without it (log-log, one colour per run; below the diagonal the context brought it closer).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from kvfuse.bench.agreement import paired_ratio_ci


def _outcomes(path: Path, method: str) -> dict[tuple[str, str], dict]:
    payload = json.loads(path.read_text(encoding="utf-8"))
    return {(o["task"], o["example_id"]): o for o in payload["outcomes"] if o["method"] == method}


def _vanilla(path: Path) -> dict[tuple[str, str], str]:
    payload = json.loads(path.read_text(encoding="utf-8"))
    return {(o["task"], o["example_id"]): o["prediction"] for o in payload["outcomes"] if o["method"] == "vanilla"}


def sign_test(wins: int, n: int) -> float:
    """Two-sided binomial p of `wins` of `n` under p = 1/2."""
    if n == 0:
        return 1.0
    k = min(wins, n - wins)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def row(label: str, task: str, pairs: list[tuple[dict, dict, str]]) -> dict:
    none_kl = [a["answer_kl_vs_vanilla"] for a, _, _ in pairs]
    mode_kl = [b["answer_kl_vs_vanilla"] for _, b, _ in pairs]
    wins = sum(m < n for n, m in zip(none_kl, mode_kl, strict=True))
    ci = paired_ratio_ci(mode_kl, none_kl)
    mean = sum(mode_kl) / sum(none_kl) if sum(none_kl) else None
    return {"run": label, "task": task, "n": len(pairs), "lower": wins, "p": sign_test(wins, len(pairs)),
            "ratio": mean, "ci": ci,
            "same_none": sum(a["prediction"] == v for a, _, v in pairs),
            "same_mode": sum(b["prediction"] == v for _, b, v in pairs)}


def plot(points: dict[str, list[tuple[float, float]]], png: Path, method: str) -> None:
    from kvfuse.bench.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 5))
    every = [v for pts in points.values() for p in pts for v in p if v > 0]
    lo, hi = min(every) / 2, max(every) * 2
    ax.plot([lo, hi], [lo, hi], color="grey", linewidth=0.8)
    for label, pts in points.items():
        ax.scatter([a for a, _ in pts], [b for _, b in pts], label=label, s=18)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="answer KL, chunks cached alone",
           ylabel="answer KL, chunks cached after a context", title=f"{method}: each example, vs vanilla")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    png = None
    if "--png" in argv:
        i = argv.index("--png")
        png, argv = Path(argv[i + 1]), argv[:i] + argv[i + 2:]
    method, runs = argv[0], [a.split("=", 1) for a in argv[1:]]
    points: dict[str, list[tuple[float, float]]] = {}
    print("| run | task | pairs | mode KL lower | sign test p | answer KL mode / none (95 % CI) "
          "| same answer as vanilla: none | mode |")
    print("|---|---|---|---|---|---|---|---|")
    for label, prefix in runs:
        base = Path(prefix + "-none.json")
        (other,) = [p for p in base.parent.glob(Path(prefix).name + "-*.json") if p != base]
        none, mode, van = _outcomes(base, method), _outcomes(other, method), _vanilla(base)
        keys = [k for k in none if k in mode and k in van]
        tasks = list(dict.fromkeys(t for t, _ in keys))
        points[label] = [(none[k]["answer_kl_vs_vanilla"], mode[k]["answer_kl_vs_vanilla"]) for k in keys]
        for task in [*tasks, "all"]:
            pairs = [(none[k], mode[k], van[k]) for k in keys if task in ("all", k[0])]
            r = row(label, task, pairs)
            ci = f" ({r['ci'][0]:.2f}–{r['ci'][1]:.2f})" if r["ci"] else ""
            ratio = f"{r['ratio']:.2f}{ci}" if r["ratio"] is not None else "–"
            print(f"| {label} | {task} | {r['n']} | {r['lower']} | {r['p']:.3f} | {ratio} | {r['same_none']} "
                  f"| {r['same_mode']} |")
    if png is not None:
        plot(points, png, method)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
