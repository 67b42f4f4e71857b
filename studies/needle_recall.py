"""Study: at ~8k tokens, does `anchor` find the needle, and would finding it be enough?

For each needle example (16 chunks x 480 tokens, r = 0.15): the share of the fact's tokens in
`anchor`'s selection, and the answer when the fact's tokens are forced into the set on top of the
anchors (`anchor_fact`: anchors + fact + the rest by evidence). If `anchor_fact` still misses answers
vanilla gets, what is left un-recomputed matters more than the selector.

Usage: python studies/needle_recall.py N [SEED]
"""

import statistics
import sys

import torch
from study_tools import DATA, FACT, fact_mask

from kvfuse.bench.engine_backend import EngineBackend
from kvfuse.bench.fidelity import kl_divergence
from kvfuse.bench.scoring import score as score_answer
from kvfuse.bench.tasks import Haystack, TaskConfig, build_examples
from kvfuse.config import load_settings

n = int(sys.argv[1])
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
be = EngineBackend(load_settings(model={"threads": 2}), max_tokens=None)
eng = be.engine
cfg = TaskConfig(n=n, docs=16, doc_tokens=480, seed=seed)
rows = []
for ex in build_examples("needle", eng.tokenizer, DATA, cfg, Haystack(eng.tokenizer, DATA)):
    prefix, chunks, q = be.prepare(ex)
    FACT["mask"] = fact_mask(eng.tokenizer, ex.chunks, ex.facts)
    assert len(FACT["mask"]) == sum(len(c) for c in chunks)
    ans = be.greedy(prefix, chunks, q, be.options("vanilla", None), ex.max_tokens)
    vt, vlog = ans.text, ans.first_logits
    fused = eng.fuse(prefix, chunks, q, be.options("anchor", 0.15), max_tokens=1)
    picked = torch.zeros_like(FACT["mask"])
    picked[fused.selected - len(prefix)] = True
    recall = float((picked & FACT["mask"]).sum() / FACT["mask"].sum())
    row = {"id": ex.id, "fact_tokens": int(FACT["mask"].sum()), "recall": recall,
           "vanilla": score_answer(ex.metric, vt, ex.answers)}
    for m in ("anchor", "anchor_fact"):
        ans = be.greedy(prefix, chunks, q, be.options(m, 0.15), ex.max_tokens)
        t, lg = ans.text, ans.first_logits
        row[m] = score_answer(ex.metric, t, ex.answers)
        row[m + "_kl"] = kl_divergence(vlog, lg)
    rows.append(row)
    print(row, flush=True)
for key in ("recall", "vanilla", "anchor", "anchor_fact", "anchor_kl", "anchor_fact_kl"):
    print(key, round(statistics.mean(r[key] for r in rows), 4))
