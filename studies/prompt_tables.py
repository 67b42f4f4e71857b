"""Tables of the prompt study (docs/results/prompt/README.md) from `kvfuse bench fidelity` result files.

    python studies/prompt_tables.py LABEL=FILE [LABEL=FILE ...] [--plot OUT.png]

Each file's tasks are pooled by document order (needle-docs and multikey-docs -> `retrieval`,
...-best-last -> `best-last`, single-haystack tasks -> `haystack`) and re-aggregated with the bench's own
measures (kvfuse.bench.fidelity.aggregate: value agreement with its interval, the floor pairing, answer
KL), one markdown row per label, order and method. With --plot, value agreement against the floor's per
row, with intervals.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from kvfuse.bench.fidelity import FLOOR, Outcome, aggregate
from kvfuse.bench.plots import method_key


def group(task: str) -> str:
    if "-docs" not in task:
        return "haystack"
    return task.split("-docs", 1)[1].lstrip("-") or "retrieval"


def rows(path: str) -> list[dict]:
    outs = [Outcome(**o) for o in json.loads(Path(path).read_text(encoding="utf-8"))["outcomes"]]
    return aggregate([dataclasses.replace(o, task=group(o.task)) for o in outs])


def fmt(x, d: int = 2) -> str:
    if x is None:
        return "–"
    if isinstance(x, (list, tuple)):
        return f"{fmt(x[0], d)}–{fmt(x[1], d)}"
    return x if isinstance(x, str) else f"{x:.{d}f}"


def main(argv: list[str]) -> int:
    plot = argv[argv.index("--plot") + 1] if "--plot" in argv else None
    specs = [a for a in argv if "=" in a and not a.startswith("--")]
    print("| run | order | method | r | n | score | same value [95 %] | floor − method [95 %] | within floor "
          "| same answer | answer KL [95 %] | TTFT / vanilla |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    shown = []
    for spec in specs:
        label, path = spec.split("=", 1)
        for r in sorted(rows(path), key=lambda r: (r["task"], method_key(r["method"]), r["ratio"])):
            shown.append((label, r))
            print(f"| {label} | {r['task']} | {r['method']} | {fmt(r['ratio'])} | {r['n']} | {fmt(r['score'])} | "
                  f"{fmt(r['same_value_vs_vanilla'])} [{fmt(r['same_value_vs_vanilla_ci'])}] | "
                  f"{fmt(r['floor_gap'])} [{fmt(r['floor_gap_ci'])}] | {fmt(r['within_floor'])} | "
                  f"{fmt(r['same_answer_vs_vanilla'])} | {fmt(r['answer_kl_vs_vanilla'], 3)} "
                  f"[{fmt(r['answer_kl_vs_vanilla_ci'], 3)}] | {fmt(r['ttft_vs_vanilla'])} |")
    if plot:
        _plot([(lb, r) for lb, r in shown if r["method"] != "vanilla"], Path(plot))
    return 0


def _plot(shown: list[tuple[str, dict]], out: Path) -> None:
    from kvfuse.bench.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(shown) + 1.2))
    for y, (_label, r) in enumerate(shown):
        lo, hi = r["same_value_vs_vanilla_ci"] or (r["same_value_vs_vanilla"],) * 2
        color = "grey" if r["method"] == FLOOR else "C0"
        ax.errorbar(r["same_value_vs_vanilla"], y, xerr=[[r["same_value_vs_vanilla"] - lo], [hi - r["same_value_vs_vanilla"]]],
                    fmt="o", color=color, capsize=3)
    ax.set_yticks(range(len(shown)), [f"{lb} · {r['task']} · {r['method']}@{fmt(r['ratio'])}" for lb, r in shown],
                  fontsize=7)
    ax.set_xlabel("same extracted value as vanilla (share, 95 % interval); grey: the floor")
    ax.set_xlim(0, 1.05)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
