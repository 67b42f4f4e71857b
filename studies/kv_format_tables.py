"""Tables and the plot of the KV-format study (docs/results/kv-formats/README.md) from `kvfuse bench
fidelity --kv-formats` result files and a `kvfuse bench store --out` file.

    python studies/kv_format_tables.py FIDELITY.json [FIDELITY.json ...] [--store STORE.json] [--plot OUT.png]

Each fidelity file's tasks are pooled (needle-docs and multikey-docs of one document order are one set of
examples) and re-aggregated with the bench's own measures (kvfuse.bench.fidelity.aggregate): per format,
value agreement with vanilla, the floor's gap (vanilla_swap's agreement minus the format's, paired) with
its interval and verdict, the gap to float16 storage (paired) with its interval, answer KL and its ratio to
float16's, and TTFT over float16's; the floors' own rows beside. With --store, each format's bytes per
token and cold-read rates against float16's. With --plot, answer KL over float16's and value agreement
against the floor per format and file, beside bytes per token.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from kvfuse.bench.fidelity import FLOOR, FLOOR_FP8, Outcome, aggregate, split_format

FORMATS = ("float16", "fp8", "int8", "int4")


def pooled(path: str) -> list[dict]:
    outs = [Outcome(**o) for o in json.loads(Path(path).read_text(encoding="utf-8"))["outcomes"]]
    return aggregate([dataclasses.replace(o, task="pooled") for o in outs])


def _ci(ci: list[float] | None) -> str:
    return "–" if not ci else f"[{ci[0]:.2f}–{ci[1]:.2f}]"


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "–" if x is None else format(x, fmt)


def fidelity_table(path: str) -> list[str]:
    rows = {r["method"]: r for r in pooled(path)}
    n = rows["vanilla"]["n"]
    out = [f"`{Path(path).name}`: {n} examples, vanilla's score {rows['vanilla']['score']:.2f}", "",
           "| run | same value [95 %] | floor − it [95 %] | within the floor | float16 − it [95 %] "
           "| answer KL [95 %] | answer KL / float16's [95 %] | TTFT / float16's |",
           "|---|---|---|---|---|---|---|---|"]
    order = [FLOOR, FLOOR_FP8, *[m for m in rows if split_format(m)[1]]]
    for m in sorted((m for m in order if m in rows), key=lambda m: (split_format(m)[1] is not None,
                                                                     FORMATS.index(split_format(m)[1] or "float16"))):
        r = rows[m]
        out.append(f"| {m} | {_num(r['same_value_vs_vanilla'], '.2f')} {_ci(r['same_value_vs_vanilla_ci'])} "
                   f"| {_num(r['floor_gap'], '.2f')} {_ci(r['floor_gap_ci'])} | {r['within_floor'] or '–'} "
                   f"| {_num(r['vs_float16_gap'], '.2f')} {_ci(r['vs_float16_gap_ci'])} "
                   f"| {_num(r['answer_kl_vs_vanilla'])} {_ci(r['answer_kl_vs_vanilla_ci'])} "
                   f"| {_num(r['answer_kl_vs_float16'], '.2f')} {_ci(r['answer_kl_vs_float16_ci'])} "
                   f"| {_num(r['ttft_vs_float16'], '.2f')} |")
    return out


def store_table(path: str) -> list[str]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    out = ["| format | bytes / token | × float16 | write tok/s | disk read tok/s (× float16) | cold read tok/s "
           "(× float16) | cold read to floats tok/s (× float16) | GiB / M tokens, default | GiB / M tokens, 8B |",
           "|---|---|---|---|---|---|---|---|---|"]
    scale = data["scale"]
    for fmt, r in data["dtypes"].items():
        vs = r["vs_float16"] or {}

        def both(key: str, r: dict = r, vs: dict = vs) -> str:
            return f"{r[key] or '–'} ({_num(vs.get(key), '.2f')}×)"
        out.append(f"| {fmt} | {r['bytes_per_token']:.0f} | {_num(vs.get('bytes_per_token'), '.3f')} "
                   f"| {r['write_tokens_per_s']} | {both('disk_read_tokens_per_s')} | {both('cold_read_tokens_per_s')} "
                   f"| {both('cold_read_floats_tokens_per_s')} | {scale['default']['formats'][fmt]['gib_per_million_tokens']} "
                   f"| {scale['llama-3.1-8b']['formats'][fmt]['gib_per_million_tokens']} |")
    return out


def plot(paths: list[str], store: str | None, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = ({f: r["vs_float16"]["bytes_per_token"] for f, r in json.loads(Path(store).read_text())["dtypes"].items()}
             if store else {})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, path in enumerate(paths):
        rows = {r["method"]: r for r in pooled(path)}
        xs, kl, lo, hi, val, vlo, vhi = [], [], [], [], [], [], []
        for f in FORMATS:
            r = next((r for m, r in rows.items() if split_format(m)[1] == f), None)
            if r is None:
                continue
            xs.append(f"{f}\n{sizes[f]:.2f}× bytes" if f in sizes else f)
            ratio, ci = (1.0, [1.0, 1.0]) if f == "float16" else (r["answer_kl_vs_float16"], r["answer_kl_vs_float16_ci"])
            kl.append(ratio)
            lo.append(ratio - ci[0])
            hi.append(ci[1] - ratio)
            v, vci = r["same_value_vs_vanilla"], r["same_value_vs_vanilla_ci"]
            val.append(v)
            vlo.append(v - vci[0])
            vhi.append(vci[1] - v)
        off = [j + 0.15 * i for j in range(len(xs))]
        label = Path(path).stem
        ax1.errorbar(off, kl, yerr=[lo, hi], fmt="o", capsize=3, label=label)
        ax2.errorbar(off, val, yerr=[vlo, vhi], fmt="o", capsize=3, label=label)
        floor = rows[FLOOR]["same_value_vs_vanilla"]
        ax2.axhline(floor, color=f"C{i}", ls="--", lw=0.8)
        ax1.set_xticks(range(len(xs)), xs)
        ax2.set_xticks(range(len(xs)), xs)
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set_ylabel("anchor's answer KL / with float16 storage")
    ax2.set_ylabel("same value as vanilla (dashed: the floor)")
    ax1.set_title("cost in answer KL, paired with float16 (95 %)")
    ax2.set_title("value agreement with vanilla (95 %)")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str]) -> int:
    store = argv[argv.index("--store") + 1] if "--store" in argv else None
    out = Path(argv[argv.index("--plot") + 1]) if "--plot" in argv else None
    skip = {store, str(out) if out else None}
    paths = [a for a in argv if a.endswith(".json") and a not in skip]
    for path in paths:
        print("\n".join(fidelity_table(path)), end="\n\n")
    if store:
        print("\n".join(store_table(store)))
    if out:
        plot(paths, store, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
