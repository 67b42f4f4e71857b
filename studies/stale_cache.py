"""Study: can the un-recomputed ("stale") part of the fused cache be corrected without recomputing it?

`anchor` selects and recomputes its r * N tokens as usual; the stale rest then gets one of these
treatments:
- `drop F`: SamKV-style sparsity. Only the fraction F of the stale tokens that the probe scores highest
  stays visible (plus, with `+tail`, the last 64 tokens of each chunk, SamKV's local blocks); the rest is
  masked out for every row that attends after selection (the recompute, the question, decoding). SamKV
  reports that a sparse cache can match a full recompute.
- `bias B, all rows`: APE-style scaling. Every stale key's attention logit gets B added (B = log S,
  S < 1 lowers the share of attention the stale context receives, as APE's scaling factor does for
  parallel contexts), for every row that attends after selection.
- `kscale C`: APE-style temperature. Stale keys are multiplied by C (their logits by C), for every row.
The engine's own `fusion.stale_logit_bias` (a bias on stale keys for the question and answer rows only)
is the `anchor, B` rows (B = -0.5 is the default); `anchor, no scaling` sets it to 0.

Attention in the variants is a plain masked call over all keys (slower than the engine's; no timings).

Usage: python studies/stale_cache.py N TASKS DOCS DOC_TOKENS [SEED]

Needs kvfuse at commit 163ffce: `fusion.stale_logit_bias` and the engine hooks it patches were removed
after it.
"""

import dataclasses
import statistics
import sys

import torch
import torch.nn.functional as F

from kvfuse.bench.data import resolve_data_dir
from kvfuse.bench.engine_backend import EngineBackend
from kvfuse.bench.fidelity import kl_divergence
from kvfuse.bench.scoring import score as score_answer
from kvfuse.bench.tasks import Haystack, TaskConfig, build_examples
from kvfuse.config import load_settings
from kvfuse.fusion.methods import anchor as A
from kvfuse.fusion.methods.base import register
from kvfuse.fusion.model import transformer

DATA = resolve_data_dir()  # the setting bench.data_dir (KVFUSE_BENCH__DATA_DIR)
TAIL = 64  # SamKV's local segment is two 64-token blocks; one is kept here (chunks are ~500 tokens)
VARIANTS = {  # name -> (visible share of stale tokens, keep chunk tails, logit bias, key scale)
    "drop 0.5": (0.5, False, 0.0, 1.0),
    "drop 0 +tail": (0.0, True, 0.0, 1.0),
    "bias -0.5, all rows": (1.0, False, -0.5, 1.0),
    "kscale 0.9": (1.0, False, 0.0, 0.9),
    "kscale 1.1": (1.0, False, 0.0, 1.1),
}
STATE = {"variant": None, "visible": None, "stale": None}


def masked_run(self, cache, h, rows, layers):
    """Transformer.run with one additive mask per call: causal, stale keys hidden or biased."""
    visible, stale, bias = STATE["visible"], STATE["stale"], VARIANTS[STATE["variant"]][2]
    stop = rows.stop
    seen = (torch.arange(stop)[None, :] <= rows.positions[:, None]) & visible[:stop][None, :]
    mask = torch.zeros(seen.shape)
    mask[:, stale[:stop]] += bias
    mask.masked_fill_(~seen, float("-inf"))
    for i in layers:
        q, k, v = self.project(i, h, rows)
        self.write_kv(cache, i, rows, k, v)
        out = F.scaled_dot_product_attention(q, cache.keys(i, stop), cache.values(i, stop), attn_mask=mask,
                                             scale=self.scale, enable_gqa=True)
        h = self.finish(i, h, out.transpose(1, 2).reshape(1, rows.count, -1))
    return h


engine_run = transformer.Transformer.run
transformer.Transformer.run = lambda self, cache, h, rows, layers: (
    engine_run(self, cache, h, rows, layers) if STATE["variant"] is None else masked_run(self, cache, h, rows, layers))


@register
class AnchorStale(A.Anchor):
    """`anchor`'s selection, unchanged; afterwards the stale tokens are treated as STATE["variant"] says."""

    name = "anchor_stale"

    def stale_bias(self, options):
        return 0.0  # the variant's treatment replaces the engine's

    def select(self, ctx):
        share, tail, _, kscale = VARIANTS[STATE["variant"]]
        n, budget = ctx.num_context, ctx.budget
        chosen = torch.zeros(n, dtype=torch.bool)
        chosen[ctx.chunk_edges(ctx.options.anchor_tokens, 0)[:budget]] = True
        layers = A.layer_window(ctx.tf.num_layers, *self.window)
        scores = A.spread(A.evidence_scores(A.probe_head_attention(ctx, layers), chosen), self.neighbours)
        scores = scores.masked_fill(chosen, float("-inf"))
        chosen[torch.topk(scores, budget - int(chosen.sum())).indices] = True
        shown = chosen.clone()
        extra = round(share * (n - int(chosen.sum())))
        if extra > 0:
            shown[torch.topk(scores.masked_fill(chosen, float("-inf")), extra).indices] = True
        if tail:
            shown[ctx.chunk_edges(0, TAIL)] = True
        ctx_span = slice(ctx.layout.context_start, ctx.layout.question_start)
        STATE["visible"] = torch.ones(ctx.cache.capacity, dtype=torch.bool)
        STATE["visible"][ctx_span] = shown
        STATE["stale"] = torch.zeros(ctx.cache.capacity, dtype=torch.bool)
        STATE["stale"][ctx_span] = ~chosen
        if kscale != 1.0:
            ctx.cache.k[:, :, STATE["stale"]] *= kscale
        return chosen.nonzero().view(-1)


n, tasks, docs, doc_tokens = int(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4])
seed = int(sys.argv[5]) if len(sys.argv) > 5 else 0
be = EngineBackend(load_settings(model={"threads": 2}), max_tokens=None)
eng = be.engine
cfg = TaskConfig(n=n, docs=docs, doc_tokens=doc_tokens, seed=seed)
for task in tasks:
    rows = []
    for ex in build_examples(task, eng.tokenizer, DATA, cfg, Haystack(eng.tokenizer, DATA)):
        prefix, chunks, q = be.prepare(ex)
        STATE["variant"] = None
        ans = be.greedy(prefix, chunks, q, be.options("vanilla", None), ex.max_tokens)
        vt, vlog = ans.text, ans.first_logits
        row = {"vanilla": (score_answer(ex.metric, vt, ex.answers), 0.0)}
        for name, bias in (("anchor, no scaling", 0.0), ("anchor, -0.25", -0.25), ("anchor, -0.5", -0.5),
                           ("anchor, -1", -1.0)):
            opts = dataclasses.replace(be.options("anchor", 0.15), stale_logit_bias=bias)
            ans = be.greedy(prefix, chunks, q, opts, ex.max_tokens)
            t, lg = ans.text, ans.first_logits
            row[name] = (score_answer(ex.metric, t, ex.answers), kl_divergence(vlog, lg))
        for name in VARIANTS:
            STATE["variant"] = name
            ans = be.greedy(prefix, chunks, q, be.options("anchor_stale", 0.15), ex.max_tokens)
            t, lg = ans.text, ans.first_logits
            STATE["variant"] = None
            row[name] = (score_answer(ex.metric, t, ex.answers), kl_divergence(vlog, lg))
        rows.append(row)
        print(task, ex.id, {k: (round(s, 3), round(kl, 4)) for k, (s, kl) in row.items()}, flush=True)
    print(task, "score / median KL:", {k: (round(statistics.mean(r[k][0] for r in rows), 3),
                                          round(statistics.median(r[k][1] for r in rows), 4)) for k in rows[0]})
