"""One method and context mode against every other, example by example (context_modes.py's output).

    python studies/method_pairs.py TARGET PREFIX [--tasks a,b]

TARGET is METHOD@MODE (e.g. anchor@document); PREFIX names a run's PREFIX-none.json and
PREFIX-<mode>.json. For each other method@mode and each task (and all tasks): the paired difference of
mean score (other − target) with its 95 % bootstrap interval, the ratio of mean answer KL (other /
target) with its paired interval (kvfuse.bench.agreement.paired_ratio_ci), and in how many examples the
other's answer KL is lower (two-sided sign test). A baseline is significantly better on a task when its
score difference interval lies above 0, or its KL ratio interval lies below 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from context_pairs import sign_test  # studies is on sys.path when this runs as a script

from kvfuse.bench.agreement import bootstrap_ci, paired_ratio_ci


def load(prefix: str) -> dict[tuple[str, str], dict[tuple[str, str], dict]]:
    """(method, mode) -> (task, example id) -> outcome."""
    out: dict = {}
    base = Path(prefix)
    for path in base.parent.glob(base.name + "-*.json"):
        mode = path.name[len(base.name) + 1:-len(".json")]
        for o in json.loads(path.read_text(encoding="utf-8"))["outcomes"]:
            if o["method"] != "vanilla":
                out.setdefault((o["method"], mode), {})[(o["task"], o["example_id"])] = o
    return out


def compare(target: dict, other: dict, task: str) -> dict | None:
    keys = [k for k in target if k in other and task in ("all", k[0])]
    if len(keys) < 2:
        return None
    diff = [other[k]["score"] - target[k]["score"] for k in keys]
    kl_t = [target[k]["answer_kl_vs_vanilla"] for k in keys]
    kl_o = [other[k]["answer_kl_vs_vanilla"] for k in keys]
    lower = sum(o < t for o, t in zip(kl_o, kl_t, strict=True))
    return {"n": len(keys), "diff": sum(diff) / len(diff), "diff_ci": bootstrap_ci(diff),
            "kl_ratio": sum(kl_o) / sum(kl_t), "kl_ci": paired_ratio_ci(kl_o, kl_t),
            "lower": lower, "p": sign_test(lower, len(keys))}


def main(argv: list[str]) -> int:
    target_name, prefix = argv[0], argv[1]
    runs = load(prefix)
    tm, tmode = target_name.split("@")
    target = runs[(tm, tmode)]
    tasks = list(dict.fromkeys(t for t, _ in target))
    print(f"| vs {target_name} | task | n | score diff (other − target) [95 %] | answer KL other / target [95 %] "
          "| other's KL lower | sign test p | significantly better |")
    print("|---|---|---|---|---|---|---|---|")
    for (method, mode), other in sorted(runs.items()):
        if (method, mode) == (tm, tmode):
            continue
        for task in [*tasks, "all"]:
            r = compare(target, other, task)
            if r is None:
                continue
            d, k = r["diff_ci"], r["kl_ci"]
            better = (d is not None and d[0] > 0) or (k is not None and k[1] < 1)
            print(f"| {method}@{mode} | {task} | {r['n']} | {r['diff']:+.3f} [{d[0]:+.3f}, {d[1]:+.3f}] "
                  f"| {r['kl_ratio']:.2f} [{k[0]:.2f}–{k[1]:.2f}] | {r['lower']} | {r['p']:.3f} "
                  f"| {'**yes**' if better else 'no'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
