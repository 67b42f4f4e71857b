"""Tables and plots of `kvfuse bench fidelity --layout multidoc` runs, joined across seeds and context modes.

    python studies/multidoc_report.py OUT LABEL=FILE[,FILE...] [LABEL=FILE[,FILE...] ...] [--tradeoff LABEL]

Each LABEL (a context mode, say `none` or `neighbours`) names fidelity result files whose outcomes are
joined (several seeds of one setting). Writes OUT.md (tables) and OUT.png; with --tradeoff LABEL also
OUT-tradeoff.png, answer agreement, answer KL and TTFT against the ratio for the methods that ran at several
ratios under that label. Per task, and over all tasks (`all`):

- per label and method: score, answer agreement with vanilla and mean answer KL, each with the bench's
  95 % bootstrap interval over examples (kvfuse.bench.fidelity.aggregate);
- paired, per label: for each pair of methods, in how many examples the first has the lower answer KL
  (sign test over the untied pairs), and the ratio of their mean answer KLs with its 95 % paired
  bootstrap interval;
- paired, per method: each label against the first (same examples, same vanilla).
Why: docs/results/fidelity-multidoc/README.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from itertools import combinations
from pathlib import Path

from kvfuse.bench.agreement import paired_ratio_ci
from kvfuse.bench.fidelity import Outcome, aggregate
from kvfuse.bench.plots import method_key
from kvfuse.bench.scoring import normalize_answer


def load(files: list[str]) -> list[Outcome]:
    out = []
    for f in files:
        out += [Outcome(**o) for o in json.loads(Path(f).read_text(encoding="utf-8"))["outcomes"]]
    return out


def pooled(outs: list[Outcome]) -> list[Outcome]:
    """The outcomes again under the task `all` (example ids stay unique: they name their task)."""
    return outs + [dataclasses.replace(o, task="all") for o in outs]


def fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "–"
    return f"{x:.{digits}f}" if abs(x) >= 10 ** -digits or x == 0 else f"{x:.1e}"


def interval(ci: list[float] | tuple[float, float] | None, digits: int = 3) -> str:
    return f"{fmt(ci[0], digits)}–{fmt(ci[1], digits)}" if ci else "–"


def sign_test(wins: int, losses: int) -> float:
    """Two-sided binomial p of `wins` against `losses` (ties left out) under p = 1/2."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, n - wins)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def by_example(outs: list[Outcome], method: str, ratio: float | None) -> dict[tuple[str, str], Outcome]:
    return {(o.task, o.example_id): o for o in outs if o.method == method and (ratio is None or o.ratio == ratio)}


def main_table(runs: dict[str, list[Outcome]], ratio: float) -> tuple[list[str], list[dict]]:
    lines = ["| task | context | method | ratio | n | score | same answer as vanilla | 95 % interval "
             "| answer KL (nats) | 95 % interval |", "|---|---|---|---|---|---|---|---|---|---|"]
    rows_out = []
    for label, outs in runs.items():
        for r in aggregate(pooled(outs)):
            if r["method"] != "vanilla" and r["ratio"] != ratio and r["method"] != "epic":
                continue
            if r["method"] == "vanilla" and label != list(runs)[0]:
                continue  # the same vanilla under every label
            rows_out.append({**r, "label": label})
    rows_out.sort(key=lambda r: (r["task"] != "all", r["task"], method_key(r["method"]), list(runs).index(r["label"])))
    for r in rows_out:
        lines.append(f"| {r['task']} | {r['label']} | {r['method']} | {fmt(r['ratio'], 2)} | {r['n']} | "
                     f"{fmt(r['score'], 2)} | {fmt(r['same_answer_vs_vanilla'], 2)} | "
                     f"{interval(r['same_answer_vs_vanilla_ci'], 2)} | {fmt(r['answer_kl_vs_vanilla'], 4)} | "
                     f"{interval(r['answer_kl_vs_vanilla_ci'], 4)} |")
    return lines, rows_out


def method_pairs(runs: dict[str, list[Outcome]], methods: list[str], ratio: float) -> list[str]:
    lines = ["| context | task | A | B | pairs | A's KL lower | sign test p | mean KL A / B (95 % CI) |",
             "|---|---|---|---|---|---|---|---|"]
    for label, outs in runs.items():
        outs = pooled(outs)
        tasks = sorted({o.task for o in outs}, key=lambda t: (t != "all", t))
        for task in tasks:
            for a, b in combinations(methods, 2):
                ea = {k: o for k, o in by_example(outs, a, None if a == "epic" else ratio).items() if k[0] == task}
                eb = {k: o for k, o in by_example(outs, b, None if b == "epic" else ratio).items() if k[0] == task}
                keys = sorted(set(ea) & set(eb))
                if not keys:
                    continue
                ka = [ea[k].answer_kl_vs_vanilla for k in keys]
                kb = [eb[k].answer_kl_vs_vanilla for k in keys]
                wins = sum(x < y for x, y in zip(ka, kb, strict=True))
                losses = sum(x > y for x, y in zip(ka, kb, strict=True))
                ci = paired_ratio_ci(ka, kb)
                lines.append(f"| {label} | {task} | {a} | {b} | {len(keys)} | {wins} | {fmt(sign_test(wins, losses))} "
                             f"| {fmt(sum(ka) / sum(kb) if sum(kb) else None, 2)} ({interval(ci, 2)}) |")
    return lines


def label_pairs(runs: dict[str, list[Outcome]], methods: list[str], ratio: float) -> list[str]:
    labels = list(runs)
    lines = ["| method | task | pairs | context | KL lower than with " + labels[0] + " | sign test p "
             "| mean KL / " + labels[0] + " (95 % CI) | same answer as vanilla: " + labels[0] + " | context |",
             "|---|---|---|---|---|---|---|---|---|"]
    base = pooled(runs[labels[0]])
    for label in labels[1:]:
        other = pooled(runs[label])
        for m in methods:
            r = None if m == "epic" else ratio
            ea, eb = by_example(base, m, r), by_example(other, m, r)
            va = by_example(base, "vanilla", None)
            for task in sorted({k[0] for k in ea}, key=lambda t: (t != "all", t)):
                keys = sorted(k for k in set(ea) & set(eb) if k[0] == task)
                if not keys:
                    continue
                ka = [ea[k].answer_kl_vs_vanilla for k in keys]
                kb = [eb[k].answer_kl_vs_vanilla for k in keys]
                wins = sum(y < x for x, y in zip(ka, kb, strict=True))
                losses = sum(y > x for x, y in zip(ka, kb, strict=True))
                ci = paired_ratio_ci(kb, ka)
                same_a = sum(_same(ea[k], va[k]) for k in keys)
                same_b = sum(_same(eb[k], va[k]) for k in keys)
                lines.append(f"| {m} | {task} | {len(keys)} | {label} | {wins} | {fmt(sign_test(wins, losses))} | "
                             f"{fmt(sum(kb) / sum(ka) if sum(ka) else None, 2)} ({interval(ci, 2)}) | {same_a} | {same_b} |")
    return lines


def _same(o: Outcome, ref: Outcome) -> bool:
    return normalize_answer(o.prediction) == normalize_answer(ref.prediction)


def plot(rows: list[dict], labels: list[str], png: Path) -> None:
    from kvfuse.bench.plots import pyplot

    plt = pyplot()
    rows = [r for r in rows if r["task"] == "all" and r["method"] != "vanilla"]
    methods = sorted({r["method"] for r in rows}, key=method_key)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.8 / max(1, len(labels))
    for li, label in enumerate(labels):
        for ax, key in zip(axes, ("same_answer_vs_vanilla", "answer_kl_vs_vanilla"), strict=True):
            xs, ys, lo, hi = [], [], [], []
            for mi, m in enumerate(methods):
                r = next((r for r in rows if r["method"] == m and r["label"] == label), None)
                if r is None or r[key] is None:
                    continue
                ci = r[key + "_ci"] or [r[key], r[key]]
                xs.append(mi + (li - (len(labels) - 1) / 2) * width)
                ys.append(r[key])
                lo.append(r[key] - ci[0])
                hi.append(ci[1] - r[key])
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=3, label=f"chunks: {label}")
    n = max((r["n"] for r in rows), default=0)
    for ax, title in zip(axes, ("same answer as vanilla (share)", "answer KL to vanilla (nats, log)"), strict=True):
        ax.set_xticks(range(len(methods)), methods)
        ax.set_title(f"{title}, n = {n}")
        ax.grid(alpha=0.3)
    _save(plt, fig, axes, png)


def _save(plt, fig, axes, png: Path) -> None:
    """Both figures: agreement on a share axis, KL on a log axis, legend, saved."""
    axes[1].set_yscale("log")
    axes[0].set_ylim(0, 1.02)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def plot_tradeoff(outs: list[Outcome], label: str, png: Path) -> None:
    from kvfuse.bench.plots import pyplot

    plt = pyplot()
    rows = [r for r in aggregate(pooled(outs)) if r["task"] == "all"]
    multi = sorted({r["method"] for r in rows if sum(x["method"] == r["method"] for x in rows) > 1}, key=method_key)
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for ax, key, title in ((axes[0], "same_answer_vs_vanilla", "same answer as vanilla (share)"),
                           (axes[1], "answer_kl_vs_vanilla", "answer KL to vanilla (nats, log)"),
                           (axes[2], "ttft_vs_vanilla", "TTFT / vanilla (median, in-process)")):
        for m in multi:
            pts = sorted((r["ratio"], r[key], r.get(key + "_ci") or [r[key], r[key]]) for r in rows if r["method"] == m)
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts],
                        yerr=[[p[1] - p[2][0] for p in pts], [p[2][1] - p[1] for p in pts]],
                        marker="o", capsize=3, label=m)
        for r in rows:
            if r["method"] not in multi and r["method"] != "vanilla":
                ci = r.get(key + "_ci") or [r[key], r[key]]
                ax.errorbar([r["ratio"]], [r[key]], yerr=[[r[key] - ci[0]], [ci[1] - r[key]]],
                            marker="s", capsize=3, ls="none", label=f"{r['method']}")
        ax.set_xlabel("recompute ratio")
        ax.set_title(f"{title}; chunks: {label}")
        ax.grid(alpha=0.3)
    _save(plt, fig, axes, png)


def main(argv: list[str]) -> int:
    tradeoff = None
    if "--tradeoff" in argv:
        i = argv.index("--tradeoff")
        tradeoff, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    out = Path(argv[0])
    runs = {label: load(files.split(",")) for label, files in (a.split("=", 1) for a in argv[1:])}
    ratio = 0.15
    methods = sorted({o.method for outs in runs.values() for o in outs} - {"vanilla"}, key=method_key)
    table, rows = main_table(runs, ratio)
    text = ["## Per method", "", *table, "", f"## Methods against each other (answer KL, r = {ratio} and epic)", "",
            *method_pairs(runs, methods, ratio), ""]
    if len(runs) > 1:
        text += [f"## Each context against {list(runs)[0]} (answer KL)", "", *label_pairs(runs, methods, ratio), ""]
    if tradeoff:
        rows_t = [r for r in aggregate(pooled(runs[tradeoff])) if r["method"] != "vanilla"]
        rows_t.sort(key=lambda r: (r["task"] != "all", r["task"], method_key(r["method"]), r["ratio"]))
        text += [f"## Against the ratio (chunks: {tradeoff})", "",
                 "| task | method | ratio | n | score | same answer as vanilla | 95 % interval | answer KL (nats) "
                 "| 95 % interval | TTFT / vanilla |", "|---|---|---|---|---|---|---|---|---|---|"]
        text += [f"| {r['task']} | {r['method']} | {fmt(r['ratio'], 2)} | {r['n']} | {fmt(r['score'], 2)} | "
                 f"{fmt(r['same_answer_vs_vanilla'], 2)} | {interval(r['same_answer_vs_vanilla_ci'], 2)} | "
                 f"{fmt(r['answer_kl_vs_vanilla'], 4)} | {interval(r['answer_kl_vs_vanilla_ci'], 4)} | "
                 f"{fmt(r['ttft_vs_vanilla'], 3)} |" for r in rows_t]
        plot_tradeoff(runs[tradeoff], tradeoff, out.with_name(out.name + "-tradeoff.png"))
    out.with_suffix(".md").write_text("\n".join(text) + "\n", encoding="utf-8")
    plot(rows, list(runs), out.with_suffix(".png"))
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
