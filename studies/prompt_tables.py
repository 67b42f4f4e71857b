"""Tables of the prompt study (docs/results/prompt/README.md) from `kvfuse bench fidelity` result files.

    python studies/prompt_tables.py LABEL=FILE[#ORDER][+FILE...] [LABEL=FILE[#ORDER] ...] [--plot OUT.png] [--pair A B ...]

Each file's tasks are pooled by document order (needle-docs and multikey-docs -> `retrieval`,
...-best-last -> `best-last`, single-haystack tasks -> `haystack`) and re-aggregated with the bench's own
measures (kvfuse.bench.fidelity.aggregate: value agreement with its interval, the floor pairing, answer
KL), one markdown row per label, order and method. With --plot, value agreement against the floor's per
row, with intervals. With --pair A B (repeatable), the same examples under two labels (ids matched with
their order suffix dropped: one example in two orders is one pair): per method and ratio, the ratio of
B's mean answer KL to A's with its paired bootstrap interval, in how many examples B's KL is lower, and
both value agreements and vanilla scores.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from kvfuse.answer_match import same_answer
from kvfuse.bench.agreement import paired_ratio_ci
from kvfuse.bench.fidelity import FLOOR, Outcome, aggregate
from kvfuse.bench.plots import method_key


def group(task: str) -> str:
    if "-docs" not in task:
        return "haystack"
    return task.split("-docs", 1)[1].lstrip("-") or "retrieval"


def outcomes(spec: str) -> list[Outcome]:
    """A file's outcomes; FILE#ORDER keeps one document order's (retrieval, best-last, haystack);
    FILE+FILE... pools several runs' (each spec part may have its own #ORDER), each example's
    method counted once (`pooled`)."""
    if "+" in spec:
        return pooled([o for part in spec.split("+") for o in outcomes(part)])
    path, _, order = spec.partition("#")
    outs = [Outcome(**o) for o in json.loads(Path(path).read_text(encoding="utf-8"))["outcomes"]]
    return [o for o in outs if not order or group(o.task) == order]


def pooled(outs: list[Outcome]) -> list[Outcome]:
    """Runs pooled once per example, method and ratio: a run that adds methods to an earlier one's
    examples repeats its vanilla (`--no-floor --methods ...` beside the run with the floor), and the
    bench is deterministic, so a repeat must give the same answer; one that does not is an error, not a
    second sample."""
    seen: dict[tuple, Outcome] = {}
    for o in outs:
        key = (o.task, o.example_id, o.method, o.ratio)
        if key in seen and seen[key].prediction != o.prediction:
            raise SystemExit(f"{key}: two pooled runs answer {seen[key].prediction!r} and {o.prediction!r}")
        seen.setdefault(key, o)
    return list(seen.values())


def rows(path: str) -> list[dict]:
    return aggregate([dataclasses.replace(o, task=group(o.task)) for o in outcomes(path)])


def pair(a_path: str, b_path: str) -> list[str]:
    """Paired lines for the same examples under two settings (see the module docstring)."""
    def index(path: str) -> dict:
        out: dict = {}
        for o in outcomes(path):
            out[(o.example_id.replace("-best-last", ""), o.method, o.ratio)] = o
        return out

    a, b = index(a_path), index(b_path)
    lines = []
    for method, ratio in sorted({(m, r) for _, m, r in a if m != "vanilla"}, key=lambda mr: (method_key(mr[0]), mr[1] or 0)):
        keys = [k for k in a if k[1:] == (method, ratio) and k in b]
        if not keys:
            continue
        van = [(a[(k[0], "vanilla", 1.0)], b[(k[0], "vanilla", 1.0)]) for k in keys]
        ka, kb = [a[k].answer_kl_vs_vanilla for k in keys], [b[k].answer_kl_vs_vanilla for k in keys]
        va = sum(same_answer(a[k].prediction, v[0].prediction, "value") for k, v in zip(keys, van, strict=True))
        vb = sum(same_answer(b[k].prediction, v[1].prediction, "value") for k, v in zip(keys, van, strict=True))
        ci = paired_ratio_ci(kb, ka)
        lines.append(f"| {method} | {fmt(ratio)} | {len(keys)} | {fmt(sum(kb) / max(sum(ka), 1e-12))} [{fmt(ci)}] | "
                     f"{sum(x < y for x, y in zip(kb, ka, strict=True))} of {len(keys)} | {va} → {vb} | "
                     f"{fmt(sum(v[0].score for v in van) / len(van))} → {fmt(sum(v[1].score for v in van) / len(van))} |")
    return lines


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
    paths = dict(spec.split("=", 1) for spec in specs)
    for i, arg in enumerate(argv):
        if arg == "--pair":
            first, second = argv[i + 1], argv[i + 2]
            print(f"\n{first} → {second}, paired:\n\n| method | r | n | answer KL ratio [95 %] | lower KL | same value "
                  "| vanilla score |\n|---|---|---|---|---|---|---|")
            print("\n".join(pair(paths[first], paths[second])))
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
