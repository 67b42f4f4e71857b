"""Why fused answers fail when the answer's document comes first: missed selection, or stale surroundings?

    python studies/multidoc_selection.py SEED N POSITIONS [TASK] [MODE] [VARIANTS]

Multi-document examples (kvfuse.bench.multidoc, 8 x 512 tokens, the shuffled draw) with the asked fact's
document moved to each of POSITIONS; chunks cached in MODE (default none), r = 0.15. Besides vanilla,
anchor and prophetkv it runs two oracles that know where the answer is:
- `anchor_fact` (studies/study_tools.py): anchor with the fact's tokens forced into the set;
- `answer_doc`: the answer's whole document recomputed, the rest of the budget to anchor's chunk starts
  and evidence.
For each run: score, answer KL to vanilla, and the share of the fact's tokens the selection recomputed.
If anchor misses the fact's tokens and anchor_fact answers as vanilla, the selection is what fails; if
anchor_fact fails too and answer_doc does not, the fact needs its document around it fresh; if both fail,
the other (stale) documents are what pulls the answer away. VARIANTS (comma list, default the four
above) may set fusion options on a method: `anchor:anchor_tokens=32`, `anchor:recompute_ratio=0.3`. Writes
bench-results/multidoc-selection-*.json.
Why: docs/results/fidelity-multidoc/README.md.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import zlib
from pathlib import Path

import torch
from study_tools import FACT, fact_mask

from kvfuse.bench import agreement, multidoc, tasks
from kvfuse.bench.data import resolve_data_dir
from kvfuse.bench.engine_backend import EngineBackend
from kvfuse.bench.fidelity import Outcome, aggregate, outcome_dicts
from kvfuse.bench.scoring import score as score_answer
from kvfuse.config import get_settings
from kvfuse.fusion.methods import anchor as A
from kvfuse.fusion.methods.base import register

RATIO = 0.15
DOC: dict = {}  # "mask": the answer document's tokens over the context [N]


@register
class AnswerDoc(A.Anchor):
    """The answer's whole document, then anchor's chunk starts and evidence in the rest of the budget."""

    name = "answer_doc"

    def select(self, ctx):
        chosen = DOC["mask"].clone()
        rest = ctx.budget - int(chosen.sum())
        if rest > 0:
            anchors = ctx.sink_starts(ctx.options.anchor_tokens)
            anchors = anchors[~chosen[anchors]][:rest]
            chosen[anchors] = True
            rest -= int(anchors.numel())
        if rest > 0:
            layers = A.layer_window(ctx.tf.num_layers, *self.window)
            scores = A.spread(A.evidence_scores(ctx.question_probe(layers), chosen), self.neighbours)
            chosen[torch.topk(scores.masked_fill(chosen, float("-inf")), rest).indices] = True
        return chosen.nonzero().view(-1)


def _number(text: str) -> int | float:
    return int(text) if text.isdigit() else float(text)


def moved(ex: tasks.Example, pos: int) -> list[int]:
    answer = ex.fact_chunks[0]
    rest = [d for d in range(len(ex.chunks)) if d != answer]
    return rest[:pos] + [answer] + rest[pos:]


def main(argv: list[str]) -> int:
    seed, n, positions = int(argv[0]), int(argv[1]), [int(p) for p in argv[2].split(",")]
    task = argv[3] if len(argv) > 3 else "needle"
    mode = argv[4] if len(argv) > 4 else "none"
    variants = (argv[5] if len(argv) > 5 else "anchor,prophetkv,anchor_fact,answer_doc").split(",")
    settings = get_settings()
    be = EngineBackend(settings, max_tokens=None, reference_dir=settings.bench.reference_dir)
    be.context_mode = mode
    corpus = multidoc.Corpus(be.tokenizer, resolve_data_dir(None), 512)
    cfg = tasks.TaskConfig(n=n, docs=8, doc_tokens=512, seed=seed)
    outs: list[Outcome] = []
    recall: dict[tuple[str, str], list[float]] = {}
    tag = "" if len(argv) <= 5 else f"-{zlib.crc32(argv[5].encode()):08x}"
    out_json = Path(f"bench-results/multidoc-selection-{task}-seed{seed}-{mode}{tag}.json")
    for ex in multidoc.build_examples(task, corpus, cfg, "shuffled"):
        prefix, chunks, question_ids = be.prepare(ex)
        for pos in positions:
            order = moved(ex, pos)
            placed = dataclasses.replace(multidoc.reordered(ex, order), task=f"{task}@{pos}")
            prepared = (prefix, [chunks[d] for d in order], question_ids)
            FACT["mask"] = fact_mask(be.tokenizer, placed.chunks, placed.facts[:1])
            lens = [len(c.token_ids) for c in prepared[1]]
            start = sum(lens[: placed.fact_chunks[0]])
            DOC["mask"] = torch.zeros(sum(lens), dtype=torch.bool)
            DOC["mask"][start : start + lens[placed.fact_chunks[0]]] = True
            van = be.run(placed, prepared, "vanilla", 1.0)
            ref, van.reference = van.reference, None
            outs.append(van)
            for m in variants:
                method, _, sets = m.partition(":")
                opts = be.options(method, RATIO)
                if sets:
                    opts = dataclasses.replace(opts, **{k: _number(v) for k, v in (x.split("=") for x in sets.split(";"))})
                budget = be.max_tokens or placed.max_tokens
                ans = be.greedy(prefix, prepared[1], question_ids, opts, budget)
                text, ttft, fused = ans.text, ans.ttft_s, ans.fused
                logits = agreement.teacher_forced_logits(be.engine, fused, ref.tokens)
                kls = agreement.token_kls(ref.logprobs, logits)
                o = Outcome(task=placed.task, example_id=placed.id, method=m, ratio=RATIO, prediction=text.strip(),
                            score=score_answer(placed.metric, text, placed.answers), ttft_s=ttft,
                            context_tokens=int(fused.stats["context_tokens"]),
                            recomputed_tokens=int(fused.stats["recomputed_tokens"]),
                            kl_vs_vanilla=kls[0], answer_kl_vs_vanilla=sum(kls) / len(kls))
                outs.append(o)
                sel = torch.zeros_like(FACT["mask"])
                sel[fused.selected - int(fused.stats["prefix_tokens"])] = True
                got = float((sel & FACT["mask"]).sum() / FACT["mask"].sum())
                recall.setdefault((placed.task, m), []).append(got)
                print(f"{placed.id} @{pos} {m}: score {o.score:.2f} (vanilla {van.prediction!r}) answer KL "
                      f"{o.answer_kl_vs_vanilla:.4f} fact recomputed {got:.2f} {o.prediction[:24]!r}", flush=True)
        out_json.write_text(json.dumps({"argv": argv, "rows": aggregate(outs), "outcomes": outcome_dicts(outs),
                                        "fact_recall": {f"{k[0]} {k[1]}": v for k, v in recall.items()}}, indent=1))
    print("| position | method | n | score | same answer | answer KL | fact tokens recomputed |")
    print("|---|---|---|---|---|---|---|")
    for r in sorted(aggregate(outs), key=lambda r: (r["task"], r["method"])):
        rec = recall.get((r["task"], r["method"]))
        print(f"| {r['task']} | {r['method']} | {r['n']} | {r['score']:.2f} | {r['same_answer_vs_vanilla']:.2f} | "
              f"{r['answer_kl_vs_vanilla']:.4f} | {sum(rec) / len(rec) if rec else 1.0:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
