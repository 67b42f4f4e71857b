"""First use's two options on the same examples (docs/results/first-use/README.md, "Option (a) or (b)").

Reads two `kvfuse bench fidelity` runs over the same examples: one with `--chunk-kv ingestion` (each
chunk's KV as eager ingestion computes it, which is what first use with the recorded context, option (a),
computes, byte for byte) and one with `--chunk-kv first-prompt` (option (b): each chunk's KV kept from the
vanilla prefill of another prompt over the same chunks). (b)'s `anchor` rows are relabelled
`anchor_first_prompt`; vanilla and the floor come from the first run (the second read vanilla from the
reference cache: the same answers). Only the examples both runs finished are kept, and the bench's own
aggregation (kvfuse.bench.fidelity.aggregate: value agreement, its interval, the floor pairing) is run
over them, per task and over all tasks.

    python studies/first_use_options.py docs/results/first-use/fidelity-ingestion.json \
        docs/results/first-use/fidelity-first-prompt.json > docs/results/first-use/options.md
"""

from __future__ import annotations

import dataclasses
import json
import sys

from kvfuse.bench.fidelity import Outcome, aggregate

B_LABEL = "anchor_first_prompt"


def outcomes(path: str) -> list[Outcome]:
    names = {f.name for f in dataclasses.fields(Outcome)}
    return [Outcome(**{k: v for k, v in o.items() if k in names}) for o in json.load(open(path))["outcomes"]]


def main(a_path: str, b_path: str) -> None:
    a = outcomes(a_path)
    b = [dataclasses.replace(o, method=B_LABEL) for o in outcomes(b_path) if o.method == "anchor"]
    both = {o.example_id for o in a if o.method == "anchor"} & {o.example_id for o in b}
    keep = [o for o in a + b if o.example_id in both]
    pooled = [dataclasses.replace(o, task="all") for o in keep]
    cols = ("task", "method", "n", "same_value_vs_vanilla", "same_value_vs_vanilla_ci", "floor_gap",
            "floor_gap_ci", "answer_kl_vs_vanilla", "score", "ttft_s_median")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in aggregate(keep) + aggregate(pooled):
        cells = []
        for c in cols:
            v = row.get(c)
            cells.append(f"{v:.3f}" if isinstance(v, float) else "–" if v is None else
                         "[" + ", ".join(f"{x:.3f}" for x in v) + "]" if isinstance(v, list | tuple) else str(v))
        print("| " + " | ".join(cells) + " |")
    print(f"\n{len(both)} examples finished by both runs.")


if __name__ == "__main__":
    main(*sys.argv[1:3])
