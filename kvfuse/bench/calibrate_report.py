"""`kvfuse calibrate`'s command, table and plot: agreement (with its 95 % Wilson interval), answer KL and
TTFT against the ratio, per method and prompt-size bucket, the ratio picked for the target marked. The
measuring is calibrate.py's."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    from kvfuse.bench.cli import csv_list

    p = sub.add_parser("calibrate", help="measure agreement with full prefill across ratios on the ingested "
                       "corpus and store the smallest ratio that meets a target (what `serve` holds)")
    p.add_argument("--target", type=float, required=True, help="agreement to meet (lower end of the 95 %% interval)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--queries", type=Path,
                        help="JSON lines: {\"query\": ..., \"document_ids\": [...]} (no document_ids: retrieved)")
    source.add_argument("--from-log", action="store_true",
                        help="a sample of the query log in data_dir (fidelity.query_log must be on)")
    p.add_argument("--sample", type=int, default=200, help="with --from-log: entries drawn (default 200; all if fewer)")
    p.add_argument("--seed", type=int, default=0, help="with --from-log: the sample's seed")
    p.add_argument("--methods", type=csv_list(str), default=None, help="default: fusion.method")
    p.add_argument("--ratios", type=csv_list(float), default=[0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0],
                   help="the ladder measured (default 0.05,0.1,0.15,0.2,0.3,0.5,1.0)")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy answer budget")
    p.add_argument("--out", type=Path, default=Path("bench-results/calibrate"),
                   help="folder of the table (.md), plot (.png) and numbers (.json)")
    p.add_argument("--dry-run", action="store_true", help="measure and report; leave the stored state alone")
    p.set_defaults(func=_calibrate)


def _calibrate(args: argparse.Namespace) -> int:
    import sys

    from kvfuse.bench.calibrate import calibrate, choose, queries_from_log, read_queries, write_state
    from kvfuse.config import get_settings

    if not 0.0 < args.target < 1.0:
        raise SystemExit("--target must be in (0, 1)")
    if any(not 0.0 <= r <= 1.0 for r in args.ratios):
        raise SystemExit("--ratios must be in [0, 1]")
    if args.sample < 1:
        raise SystemExit("--sample must be at least 1")
    settings = get_settings()
    methods = args.methods or [settings.fusion.method]
    try:
        queries = (queries_from_log(settings, args.sample, args.seed) if args.from_log
                   else read_queries(args.queries))
    except ValueError as err:
        print(f"kvfuse calibrate: {err}", file=sys.stderr)
        return 2
    run = calibrate(settings, queries, methods, sorted(args.ratios), args.target, args.max_tokens)
    if not run["queries"]:
        print(f"kvfuse calibrate: none of the {len(queries)} queries could be measured (see the warnings)",
              file=sys.stderr)
        return 2
    picks = choose(run)
    args.out.mkdir(parents=True, exist_ok=True)
    table = render_table(run, picks)
    (args.out / "calibrate.md").write_text(table)
    (args.out / "calibrate.json").write_text(json.dumps(to_json(run, picks), indent=1))
    plot(run, picks, args.out / "calibrate.png")
    print(table)
    if args.dry_run:
        print(f"(dry run: state not written; results in {args.out})")
    else:
        print(f"state written: {write_state(settings, run, picks)} (a running server reads it at its next start)")
    return 0


def _cells(run: dict[str, Any]) -> list[dict[str, Any]]:
    from kvfuse.service.rag.fidelity_control import wilson

    rows = []
    for (method, bucket, r), c in sorted(run["cells"].items()):
        n, k = len(c.agreed), sum(c.agreed)
        lo, hi = wilson(k, n)
        ttft = sorted(c.ttft_s)
        rows.append({"method": method, "bucket": bucket, "ratio": r, "n": n, "agreements": k, "agreement": k / n,
                     "lower": lo, "upper": hi, "mean_answer_kl": sum(c.kl) / n, "ttft_s_median": ttft[n // 2]})
    return rows


def to_json(run: dict[str, Any], picks: dict) -> dict[str, Any]:
    full = {b: sorted(t)[len(t) // 2] for b, t in run["full_ttft_s"].items()}
    return {k: run[k] for k in ("target", "metric", "ratios", "methods", "fingerprint", "queries", "max_tokens")} | {
        "cells": _cells(run), "full_prefill_ttft_s_median": full,
        "picks": [{"method": m, "bucket": b, **p} for (m, b), p in sorted(picks.items())]}


def render_table(run: dict[str, Any], picks: dict) -> str:
    full = {b: sorted(t)[len(t) // 2] for b, t in run["full_ttft_s"].items()}
    lines = [f"Target agreement {run['target']} ({run['metric']} metric), {run['queries']} queries, "
             f"greedy answers of at most {run['max_tokens']} tokens.", "",
             "| method | bucket | ratio | n | agreement | 95 % interval | answer KL | TTFT median (s) | TTFT / full |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in _cells(run):
        pick = picks.get((c["method"], c["bucket"]))
        mark = " **←**" if pick and pick["ratio"] == c["ratio"] else ""
        lines.append(f"| {c['method']} | {c['bucket']} | {c['ratio']:.2f}{mark} | {c['n']} | {c['agreement']:.2f} | "
                     f"[{c['lower']:.2f}, {c['upper']:.2f}] | {c['mean_answer_kl']:.4f} | {c['ttft_s_median']:.3f} | "
                     f"{c['ttft_s_median'] / full[c['bucket']]:.2f} |")
    lines += ["", "Full prefill's median TTFT: " + ", ".join(f"{b}: {t:.3f} s" for b, t in sorted(full.items())), ""]
    for (m, b), p in sorted(picks.items()):
        verdict = "meets the target" if p["met"] else "NO ratio tried meets the target; the largest is held"
        lines.append(f"- {m}, {b}: ratio {p['ratio']} ({p['agreements']}/{p['checks']}, lower end "
                     f"{p['lower']:.3f}): {verdict}")
    return "\n".join(lines) + "\n"


def plot(run: dict[str, Any], picks: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = _cells(run)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for key in sorted({(c["method"], c["bucket"]) for c in cells}):
        rows = [c for c in cells if (c["method"], c["bucket"]) == key]
        x = [c["ratio"] for c in rows]
        y = [c["agreement"] for c in rows]
        err = [[c["agreement"] - c["lower"] for c in rows], [c["upper"] - c["agreement"] for c in rows]]
        line = ax1.errorbar(x, y, yerr=err, marker="o", capsize=3, label=f"{key[0]} {key[1]}")
        ax2.plot(x, [c["ttft_s_median"] for c in rows], marker="o", color=line[0].get_color(), label=f"{key[0]} {key[1]}")
        pick = picks.get(key)
        if pick is not None:
            ax1.axvline(pick["ratio"], color=line[0].get_color(), ls=":", lw=1)
    ax1.axhline(run["target"], color="grey", ls="--", lw=1, label=f"target {run['target']}")
    ax1.set(xlabel="recompute ratio", ylabel=f"agreement with full prefill ({run['metric']})", ylim=(0, 1.05),
            title="agreement, 95 % Wilson interval")
    for b, t in sorted(run["full_ttft_s"].items()):
        ax2.axhline(sorted(t)[len(t) // 2], ls="--", lw=1, color="grey", label=f"full prefill {b}")
    ax2.set(xlabel="recompute ratio", ylabel="median TTFT (s)", title="time to first token")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
