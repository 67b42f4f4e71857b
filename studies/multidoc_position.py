"""Where the answer's document sits in a multi-document prompt, and how far fused answers are from vanilla's.

    python studies/multidoc_position.py SEED N POSITIONS METHODS [TASK] [MODE]

For N examples of the multi-document layout (kvfuse.bench.multidoc, 8 documents of 512 tokens, shuffled
draw), the document holding the asked fact is moved to each of POSITIONS (comma list; the other
documents keep their order) and vanilla and METHODS (at r = 0.15) run on each arrangement, chunks cached
in MODE (default none). The chunks are precomputed once per example (a chunk's cache does not depend on
where it is fused). Prints one line per run and a table of score and answer KL per position and method.
Why: docs/results/fidelity-multidoc/README.md ("Where the answer sits").
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from kvfuse.bench import multidoc, tasks
from kvfuse.bench.data import resolve_data_dir
from kvfuse.bench.engine_backend import EngineBackend
from kvfuse.bench.fidelity import aggregate, outcome_dicts
from kvfuse.config import get_settings

RATIO = 0.15


def moved(ex: tasks.Example, pos: int) -> list[int]:
    """The document order with the asked fact's document at `pos`, the others in their order."""
    answer = ex.fact_chunks[0]
    rest = [d for d in range(len(ex.chunks)) if d != answer]
    return rest[:pos] + [answer] + rest[pos:]


def main(argv: list[str]) -> int:
    seed, n, positions, methods = int(argv[0]), int(argv[1]), [int(p) for p in argv[2].split(",")], argv[3].split(",")
    task = argv[4] if len(argv) > 4 else "needle"
    mode = argv[5] if len(argv) > 5 else "none"
    settings = get_settings()
    backend = EngineBackend(settings, max_tokens=None, reference_dir=settings.bench.reference_dir)
    backend.context_mode = mode
    data = resolve_data_dir(None)
    corpus = multidoc.Corpus(backend.tokenizer, data, 512)
    cfg = tasks.TaskConfig(n=n, docs=8, doc_tokens=512, seed=seed)
    outs = []
    out_json = Path(f"bench-results/multidoc-position-{task}-seed{seed}-{mode}.json")
    for ex in multidoc.build_examples(task, corpus, cfg, "shuffled"):
        prefix, chunks, question_ids = backend.prepare(ex)
        for pos in positions:
            order = moved(ex, pos)
            placed = dataclasses.replace(multidoc.reordered(ex, order), task=f"{task}@{pos}")
            prepared = (prefix, [chunks[d] for d in order], question_ids)
            van = backend.run(placed, prepared, "vanilla", 1.0)
            ref, van.reference = van.reference, None
            outs.append(van)
            for m in methods:
                o = backend.run(placed, prepared, m, None if m == "epic" else RATIO, reference=ref)
                outs.append(o)
                print(f"{placed.id} @{pos} {m}: score {o.score:.2f} vanilla {van.prediction!r} "
                      f"answer KL {o.answer_kl_vs_vanilla:.4f} {o.prediction[:30]!r}", flush=True)
        out_json.write_text(json.dumps({"rows": aggregate(outs), "outcomes": outcome_dicts(outs)}, indent=1))
    print("| position | method | n | score | same answer | answer KL |\n|---|---|---|---|---|---|")
    for r in sorted(aggregate(outs), key=lambda r: (r["task"], r["method"])):
        print(f"| {r['task']} | {r['method']} | {r['n']} | {r['score']:.2f} | {r['same_answer_vs_vanilla']:.2f} | "
              f"{r['answer_kl_vs_vanilla']:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
