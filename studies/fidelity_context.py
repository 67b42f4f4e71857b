"""Gather `kvfuse bench fidelity --precompute-context MODE` runs into one table and plot.

    python studies/fidelity_context.py OUT_PREFIX RUN.json [RUN.json ...]

Each RUN.json is one fidelity run (one context mode; its label is the mode, or `label=path` to name it).
Writes OUT_PREFIX.json, OUT_PREFIX.md (task × method × mode: score / vanilla, agreement and answer KL,
each with its 95 % paired bootstrap interval, and the examples a ±0.05 interval of score / vanilla would
need at the same spread) and OUT_PREFIX.png (answer KL with its interval).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvfuse.bench.agreement import examples_for_width
from kvfuse.bench.plots import method_key, pyplot

TASK_ORDER = ("needle", "multikey", "multivalue", "vartrack", "musique")


def _f(x, d=3):
    if x is None:
        return "–"
    if isinstance(x, list):
        return f"{x[0]:.{d}f}–{x[1]:.{d}f}"
    return f"{x:.{d}f}"


def gather(runs: list[tuple[str, dict]]) -> list[dict]:
    rows = []
    for label, payload in runs:
        for r in payload["rows"]:
            ci = r.get("score_vs_vanilla_ci")
            rows.append({**r, "mode": label, "command": payload["command"],
                         "ingest": payload.get("ingest"),
                         "n_for_pm005": examples_for_width(r["n"], ci, 0.05) if r["method"] != "vanilla" else None})
    rows.sort(key=lambda r: (TASK_ORDER.index(r["task"]) if r["task"] in TASK_ORDER else 9,
                             method_key(r["method"]), r["mode"]))
    return rows


def markdown(rows: list[dict], runs: list[tuple[str, dict]]) -> str:
    out = ["| task | method | context | n | score | score / vanilla [95 %] | same answer [95 %] | "
           "answer KL [95 %] | first-token KL | n for ±0.05 |", "|---|---|---|---|---|---|---|---|---|---|"]
    seen_vanilla = set()
    for r in rows:
        if r["method"] == "vanilla":
            if r["task"] in seen_vanilla:
                continue
            seen_vanilla.add(r["task"])
            out.append(f"| {r['task']} | vanilla | – | {r['n']} | {_f(r['score'])} | 1 | 1 | 0 | 0 | |")
            continue
        out.append(
            f"| {r['task']} | {r['method']} | {r['mode']} | {r['n']} | {_f(r['score'])} | "
            f"{_f(r['score_vs_vanilla'], 2)} [{_f(r['score_vs_vanilla_ci'], 2)}] | "
            f"{_f(r['same_answer_vs_vanilla'], 2)} [{_f(r['same_answer_vs_vanilla_ci'], 2)}] | "
            f"{_f(r['answer_kl_vs_vanilla'], 4)} [{_f(r['answer_kl_vs_vanilla_ci'], 4)}] | "
            f"{_f(r['kl_vs_vanilla'], 4)} | {r['n_for_pm005'] or '–'} |")
    out += ["", "| context | chunk tokens | context tokens | precompute (s) | embed (s) | chunk tokens/s |",
            "|---|---|---|---|---|---|"]
    for label, payload in runs:
        ing = payload.get("ingest") or {}
        out.append(f"| {label} | {ing.get('chunk_tokens', '–')} | {ing.get('context_tokens', '–')} | "
                   f"{_f(ing.get('precompute_s'), 1)} | {_f(ing.get('embed_s'), 1)} | "
                   f"{_f(ing.get('chunk_tokens_per_s'), 0)} |")
    out += ["", "Commands:", ""] + [f"- `{label}`: `{payload['command']}`" for label, payload in runs]
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    tasks = [t for t in TASK_ORDER if any(r["task"] == t for r in rows)]
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        sel = [r for r in rows if r["task"] == task and r["method"] != "vanilla"]
        labels = [f"{r['method']}\n{r['mode']}" for r in sel]
        ys = [r["answer_kl_vs_vanilla"] or 0.0 for r in sel]
        lo = [y - (r["answer_kl_vs_vanilla_ci"] or [y, y])[0] for y, r in zip(ys, sel, strict=True)]
        hi = [(r["answer_kl_vs_vanilla_ci"] or [y, y])[1] - y for y, r in zip(ys, sel, strict=True)]
        ax.bar(range(len(sel)), ys, yerr=[lo, hi], capsize=3, color="tab:blue")
        ax.set_xticks(range(len(sel)), labels, rotation=60, fontsize=7)
        ax.set_title(f"{task} (n = {sel[0]['n'] if sel else 0})")
        ax.set_ylabel("answer KL to vanilla (nats)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    prefix = Path(argv[0])
    runs = []
    for arg in argv[1:]:
        label, _, path = arg.rpartition("=")
        payload = json.loads(Path(path).read_text())
        runs.append((label or payload["params"].get("precompute_context", {}).get("precompute_context", path),
                     payload))
    rows = gather(runs)
    prefix.with_suffix(".json").write_text(json.dumps({"runs": [lbl for lbl, _ in runs], "rows": rows}, indent=1))
    prefix.with_suffix(".md").write_text(markdown(rows, runs))
    plot(rows, prefix.with_suffix(".png"))
    print(prefix.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
