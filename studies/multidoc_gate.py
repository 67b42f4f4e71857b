"""Can a query-time signal tell which requests fusion will change, and is spending more recompute on
those requests better than spreading it evenly? Offline, over `kvfuse bench fidelity` runs of one method
at several ratios (and vanilla).

    python studies/multidoc_gate.py OUT FILE[,FILE...] [--method anchor] [--base 0.15] [--fractions 0.1,0.2,0.3]
                                    [--calibrate FILE]

For each query-time signal recorded at the base ratio (the fused first token's margin and entropy,
anchor's evidence coverage) and, where the run has a lower ratio too, self-consistency (the answer at
the next lower ratio differs: that second fusion is paid on every request), it reports:
- its AUROC for "the answer differs from vanilla's at the base ratio" (0.5: chance);
- gates: fuse at the base ratio, and re-answer a fraction f of the requests, those whose signal is
  worst, at a higher ratio r1 or with vanilla (the first fusion is spent: cost base + f * r1 in mean
  recomputed ratio). Each gate's agreement with vanilla and answer KL are set against the uniform ratio
  of the run nearest its cost (paired bootstrap interval of the difference), against a random choice of
  the same f (expected value) and against an oracle that knows which answers changed.
--calibrate FILE: each gate's threshold is the signal's quantile fixed on another run (a second
setting or seed) and applied here, as a calibrated gate would be; without it the top f of this run are
taken (the best case for the signal).
Writes OUT.md and OUT.json. Why: docs/results/fidelity-multidoc/README.md.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from kvfuse.bench.fidelity import Outcome
from kvfuse.bench.scoring import normalize_answer

# signal name -> (Outcome field, True when a high value means "safe")
SIGNALS = {"margin": ("first_margin", True), "entropy": ("first_entropy", False),
           "coverage": ("evidence_coverage", True)}
RESAMPLES = 2000


def load(path: str, method: str) -> tuple[dict[str, Outcome], dict[float, dict[str, Outcome]]]:
    """Vanilla's outcome and the method's per ratio, by example, from one file or several joined by
    commas (pooled: example ids name their seed and order, so they stay unique)."""
    outs = [Outcome(**o) for f in path.split(",") for o in json.loads(Path(f).read_text(encoding="utf-8"))["outcomes"]]
    vanilla = {o.example_id: o for o in outs if o.method == "vanilla"}
    by_ratio: dict[float, dict[str, Outcome]] = {}
    for o in outs:
        if o.method == method:
            by_ratio.setdefault(o.ratio, {})[o.example_id] = o
    return vanilla, by_ratio


def same(o: Outcome, ref: Outcome) -> float:
    return float(normalize_answer(o.prediction) == normalize_answer(ref.prediction))


def auroc(risk: list[float], bad: list[float]) -> float | None:
    """P(a changed answer has a higher risk than an unchanged one), ties counted half."""
    pos = [r for r, b in zip(risk, bad, strict=True) if b]
    neg = [r for r, b in zip(risk, bad, strict=True) if not b]
    if not pos or not neg:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def auroc_ci(risk: list[float], bad: list[float]) -> tuple[float, float] | None:
    """95 % bootstrap interval of the AUROC over examples."""
    rng = random.Random(0)
    n = len(risk)
    vals = []
    for _ in range(RESAMPLES // 4):
        idx = [rng.randrange(n) for _ in range(n)]
        a = auroc([risk[i] for i in idx], [bad[i] for i in idx])
        if a is not None:
            vals.append(a)
    if len(vals) < 10:
        return None
    vals.sort()
    return vals[int(0.025 * (len(vals) - 1))], vals[int(0.975 * (len(vals) - 1))]


def paired_diff_ci(a: list[float], b: list[float]) -> tuple[float, float]:
    rng = random.Random(0)
    n = len(a)
    diffs = sorted(sum(a[i] - b[i] for i in idx) / n
                   for idx in ([rng.randrange(n) for _ in range(n)] for _ in range(RESAMPLES)))
    return diffs[int(0.025 * (RESAMPLES - 1))], diffs[int(0.975 * (RESAMPLES - 1))]


def risk_of(o: Outcome, signal: str, consistent: dict[str, float] | None = None) -> float:
    if signal == "consistency":  # 1 when the cheaper fusion's answer differs from this one
        return 1.0 - consistent[o.example_id]
    field, high_is_safe = SIGNALS[signal]
    v = getattr(o, field)
    return -v if high_is_safe else v


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    path = argv[1]
    opts = dict(zip(argv[2::2], argv[3::2], strict=True))
    method = opts.get("--method", "anchor")
    fractions = [float(f) for f in opts.get("--fractions", "0.1,0.2,0.3").split(",")]
    vanilla, by_ratio = load(path, method)
    ratios = sorted(by_ratio)
    r0 = float(opts.get("--base", ratios[0]))
    ids = sorted(set(vanilla) & set.intersection(*(set(v) for v in by_ratio.values())))
    n = len(ids)
    base = by_ratio[r0]
    agree_at = {r: [same(by_ratio[r][i], vanilla[i]) for i in ids] for r in ratios}
    kl_at = {r: [by_ratio[r][i].answer_kl_vs_vanilla for i in ids] for r in ratios}
    changed = [1.0 - a for a in agree_at[r0]]
    present = [s for s in SIGNALS if all(getattr(base[i], SIGNALS[s][0]) is not None for i in ids)]
    lower = [r for r in ratios if r < r0]
    probe_cost: dict[str, float] = {}
    consistent: dict[str, float] = {}
    if lower:  # self-consistency: the answer at the next lower ratio differs (costs that fusion too)
        low = by_ratio[lower[-1]]
        consistent.update({i: same(low[i], base[i]) for i in ids})
        present.append("consistency")
        probe_cost["consistency"] = lower[-1]
    report: dict = {"file": path, "method": method, "n": n, "base": r0, "auroc": {}, "gates": [],
                    "uniform": {r: {"agreement": sum(agree_at[r]) / n, "answer_kl": sum(kl_at[r]) / n}
                                for r in ratios}}
    lines = [f"# Gating by a query-time signal: {method}, {', '.join(Path(f).name for f in path.split(','))}", "",
             f"{n} examples; base ratio {r0}; at the base, {int(sum(changed))} of {n} answers differ from "
             "vanilla's. Uniform ratios of the same run: " + ", ".join(
                 f"r = {r}: agreement {sum(agree_at[r]) / n:.2f}, answer KL {sum(kl_at[r]) / n:.3f}" for r in ratios)
             + ".", "", "## How well each signal at the base ratio finds the changed answers", "",
             "| signal | AUROC [95 %] |", "|---|---|"]
    for s in present:
        risk = [risk_of(base[i], s, consistent) for i in ids]
        a, ci = auroc(risk, changed), auroc_ci(risk, changed)
        report["auroc"][s] = {"auroc": a, "ci": ci}
        lines.append(f"| {s} | {a:.2f} [{ci[0]:.2f}–{ci[1]:.2f}] |" if a is not None and ci else f"| {s} | – |")
    calib = None
    if "--calibrate" in opts:
        cv, cr = load(opts["--calibrate"], method)
        calib = [cr[r0][i] for i in sorted(set(cv) & set(cr[r0]))]
    lines += ["", "## Gates against the uniform ratio nearest their cost", "",
              "| re-answer with | f | signal | re-answered | cost (mean ratio) | agreement | vs uniform r | "
              "Δ agreement [95 %] | answer KL | Δ answer KL [95 %] |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r1 in [*(r for r in ratios if r > r0), 1.0]:
        top = by_ratio.get(r1)  # None: vanilla
        for f in fractions:
            k = max(1, round(f * n))
            for s in [*present, "random", "oracle"]:
                if s == "oracle":
                    chosen = set(sorted(range(n), key=lambda j: -changed[j])[:k])
                elif s == "random":
                    chosen = None
                elif s == "consistency":  # a flag, not a score: every flagged request, once per r1
                    if f != fractions[0]:
                        continue
                    chosen = {j for j in range(n) if not consistent[ids[j]]}
                elif calib is not None:
                    q = sorted((risk_of(o, s, consistent) for o in calib), reverse=True)[max(0, round(f * len(calib)) - 1)]
                    chosen = {j for j in range(n) if risk_of(base[ids[j]], s, consistent) >= q}
                else:
                    chosen = set(sorted(range(n), key=lambda j: -risk_of(base[ids[j]], s, consistent))[:k])
                hi_agree = [1.0] * n if top is None else agree_at[r1]
                hi_kl = [0.0] * n if top is None else kl_at[r1]
                if chosen is None:  # expected value of a random choice of k
                    agree = [(1 - k / n) * agree_at[r0][j] + k / n * hi_agree[j] for j in range(n)]
                    kls = [(1 - k / n) * kl_at[r0][j] + k / n * hi_kl[j] for j in range(n)]
                    m = k
                else:
                    agree = [hi_agree[j] if j in chosen else agree_at[r0][j] for j in range(n)]
                    kls = [hi_kl[j] if j in chosen else kl_at[r0][j] for j in range(n)]
                    m = len(chosen)
                cost = r0 + m / n * r1 + probe_cost.get(s, 0.0)
                ur = min(ratios, key=lambda r: abs(r - cost))
                da, dk = paired_diff_ci(agree, agree_at[ur]), paired_diff_ci(kls, kl_at[ur])
                row = {"r1": r1, "f": f, "signal": s, "re_answered": m, "cost": cost, "agreement": sum(agree) / n,
                       "answer_kl": sum(kls) / n, "uniform_ratio": ur, "agreement_diff_ci": da,
                       "answer_kl_diff_ci": dk}
                report["gates"].append(row)
                lines.append(
                    f"| {'vanilla' if top is None else f'r = {r1}'} | {f} | {s} | {m} | {cost:.3f} | "
                    f"{row['agreement']:.2f} | {ur} | {row['agreement'] - sum(agree_at[ur]) / n:+.2f} "
                    f"[{da[0]:+.2f}, {da[1]:+.2f}] | {row['answer_kl']:.3f} | "
                    f"{row['answer_kl'] - sum(kl_at[ur]) / n:+.3f} [{dk[0]:+.3f}, {dk[1]:+.3f}] |")
    lines += ["", "Thresholds " + (f"fixed on {Path(opts['--calibrate']).name} (the signal's quantile there)"
                                   if calib is not None else "chosen on this run (the best case for the signal)")
              + "; random: the expected value of re-answering f of the requests at random."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out.with_suffix(".json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    plot(report, out.with_suffix(".png"))
    print("\n".join(lines))


def plot(report: dict, path: Path) -> None:
    """Agreement against cost: the uniform ratios as a line, each gate that falls back to vanilla as points
    per signal (one per fraction)."""
    from kvfuse.bench.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    uni = sorted((float(r), v["agreement"]) for r, v in report["uniform"].items())
    ax.plot([r for r, _ in uni], [a for _, a in uni], "k-o", label="uniform ratio")
    for s, marker in zip(["margin", "entropy", "coverage", "consistency", "random", "oracle"], "s^Dvxo", strict=True):
        pts = [(g["cost"], g["agreement"]) for g in report["gates"] if g["signal"] == s and g["r1"] == 1.0]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker, ls=":", label=f"fall back to vanilla by {s}")
    ax.set(xlabel="cost: mean recomputed ratio (vanilla = 1)", ylabel="same answer as vanilla",
           title=f"{report['method']}: gate at r = {report['base']}, n = {report['n']}", ylim=(0, 1.02))
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main(sys.argv[1:])
