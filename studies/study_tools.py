"""Pieces the study scripts share: their command line, the fidelity benchmark's examples, the fact mask
and a fact-forcing variant of `anchor`, and the benchmark's own aggregation of their outcomes.

The scripts run as `python studies/NAME.py ...`, so this folder is on their import path.
"""

import json
import sys
from pathlib import Path

import torch

from kvfuse.bench import report
from kvfuse.bench.data import resolve_data_dir
from kvfuse.bench.fidelity import Outcome, aggregate, kl_divergence, outcome_dicts
from kvfuse.bench.scoring import score as score_answer
from kvfuse.fusion.methods import anchor as A
from kvfuse.fusion.methods.base import register

DATA = resolve_data_dir()  # the setting bench.data_dir (KVFUSE_BENCH__DATA_DIR)
FACT: dict = {}  # "mask": the current example's fact tokens over the context [N] (for anchor_fact)


@register
class AnchorFact(A.Anchor):
    """anchor with the example's fact tokens (FACT["mask"]) forced into the set on top of the anchors;
    the rest of the budget by evidence. An oracle: it knows where the answer is."""

    name = "anchor_fact"

    def select(self, ctx):
        chosen = FACT["mask"].clone()
        chosen[ctx.chunk_edges(ctx.options.anchor_tokens, 0)] = True
        layers = A.layer_window(ctx.tf.num_layers, *self.window)
        scores = A.spread(A.evidence_scores(ctx.question_probe(layers), chosen), self.neighbours)
        rest = ctx.budget - int(chosen.sum())
        if rest > 0:
            chosen[torch.topk(scores.masked_fill(chosen, float("-inf")), rest).indices] = True
        return chosen.nonzero().view(-1)


def fact_mask(tok, chunks, facts) -> torch.Tensor:
    """Context token positions covered by any fact's characters."""
    marks = []
    for text in chunks:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        spans = [(text.find(f), text.find(f) + len(f)) for f in facts if f in text]
        marks += [any(a < e and b > s for s, e in spans) for a, b in enc["offset_mapping"]]
    return torch.tensor(marks)


def task_args() -> tuple[list[str], int, int, int, int, Path | None]:
    """TASKS N [SEED] [DOCS] [DOC_TOKENS] [JSON] from the command line."""
    argv = sys.argv
    tasks, n = argv[1].split(","), int(argv[2])
    seed = int(argv[3]) if len(argv) > 3 else 0
    docs = int(argv[4]) if len(argv) > 4 else 8
    doc_tokens = int(argv[5]) if len(argv) > 5 else 512
    out_json = Path(argv[6]) if len(argv) > 6 else None
    return tasks, n, seed, docs, doc_tokens, out_json


def outcome(ex, label: str, ratio: float | None, answer, ref_logits) -> Outcome:
    """An Outcome from `EngineBackend.greedy`'s answer, first-token KL against `ref_logits`."""
    text, logits, ttft, stats = answer.text, answer.first_logits, answer.ttft_s, answer.stats
    return Outcome(task=ex.task, example_id=ex.id, method=label, ratio=ratio, prediction=text.strip(),
                   score=score_answer(ex.metric, text, ex.answers), ttft_s=ttft,
                   context_tokens=int(stats["context_tokens"]), recomputed_tokens=int(stats["recomputed_tokens"]),
                   kl_vs_vanilla=kl_divergence(ref_logits, logits))


def report_outcomes(outcomes: list[Outcome], out_json: Path | None) -> None:
    """Print the benchmark's tables for the outcomes; write them (and the raw outcomes) to `out_json`."""
    rows = report.sort_fidelity(aggregate(outcomes))
    print(report.fidelity_against_vanilla(rows))
    print(report.markdown_table(rows, [c for c in report.FIDELITY_TABLE if c[0] not in ("ratio", "ttft_vs_vanilla")]))
    if out_json is not None:
        out_json.write_text(json.dumps({"argv": sys.argv[1:], "rows": rows, "outcomes": outcome_dicts(outcomes)},
                                       indent=1) + "\n", encoding="utf-8")
