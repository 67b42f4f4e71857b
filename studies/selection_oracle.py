"""Study: anchor against an oracle selection and two variants.

oracle: the r*N context tokens whose position-recovered K/V deviate most from vanilla's own cache
(relative L2, averaged over layers and heads): the best any deviation-driven selector (CacheBlend's
principle) could pick. oracle_anchor: the same after the 16 chunk-start anchors. anchor0: no anchors.
anchor_pc: half the evidence budget split evenly across chunks.

Usage: python studies/selection_oracle.py N TASKS [SEED]   e.g. 4 needle,multikey,multivalue,musique 0
Run from the repository root with the project's environment; the data directory defaults to
the evaluation data (setting bench.data_dir). Prints, per task, each variant's mean score, median and mean
first-token KL to vanilla (nats) and how many answers equal vanilla's, on the fidelity benchmark's own
examples (8 chunks x 512 tokens, r = 0.15, greedy, the configured system prompt).
"""

import dataclasses
import statistics
import sys
import time
from typing import ClassVar

import torch

from kvfuse.bench.data import resolve_data_dir
from kvfuse.bench.engine_backend import EngineBackend
from kvfuse.bench.fidelity import kl_divergence
from kvfuse.bench.scoring import score as score_answer
from kvfuse.bench.tasks import Haystack, TaskConfig, build_examples
from kvfuse.config import load_settings
from kvfuse.fusion.engine.fused_cache import FusedCache
from kvfuse.fusion.methods import anchor as A
from kvfuse.fusion.methods.base import FusionMethod, register
from kvfuse.fusion.types import Layout

DATA = resolve_data_dir()  # the setting bench.data_dir (KVFUSE_BENCH__DATA_DIR)
ORACLE = {}  # the current example's oracle scores

@register
class Oracle(FusionMethod):
    name = "oracle"
    def select(self, ctx):
        return torch.topk(ORACLE["scores"], ctx.budget).indices

@register
class OracleAnchor(FusionMethod):
    name = "oracle_anchor"
    def select(self, ctx):
        n, budget = ctx.num_context, ctx.budget
        chosen = torch.zeros(n, dtype=torch.bool)
        anchors = ctx.chunk_edges(ctx.options.anchor_tokens, 0)[:budget]
        chosen[anchors] = True
        s = ORACLE["scores"].clone().masked_fill(chosen, float("-inf"))
        chosen[torch.topk(s, budget - anchors.numel()).indices] = True
        return chosen.nonzero().view(-1)

@register
class AnchorPC(A.Anchor):
    name = "anchor_pc"
    share: ClassVar[float] = 0.5
    def select(self, ctx):
        n, budget = ctx.num_context, ctx.budget
        chosen = torch.zeros(n, dtype=torch.bool)
        anchors = ctx.chunk_edges(ctx.options.anchor_tokens, 0)[:budget]
        chosen[anchors] = True
        rest = budget - int(anchors.numel())
        layers = A.layer_window(ctx.tf.num_layers, *self.window)
        scores = A.spread(A.evidence_scores(ctx.question_probe(layers), chosen), self.neighbours)
        scores = scores.masked_fill(chosen, float("-inf"))
        lens = ctx.layout.chunk_lens
        per = int(rest * self.share) // len(lens)
        start = 0
        for L in lens:
            seg = scores[start:start + L]
            k = min(per, int(torch.isfinite(seg).sum()))
            if k > 0:
                chosen[start + torch.topk(seg, k).indices] = True
            start += L
        left = budget - int(chosen.sum())
        scores = scores.masked_fill(chosen, float("-inf"))
        chosen[torch.topk(scores, left).indices] = True
        return chosen.nonzero().view(-1)

n, tasks = int(sys.argv[1]), sys.argv[2].split(",")
seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
be = EngineBackend(load_settings(model={"threads": 2}), max_tokens=None)
eng = be.engine
hay = Haystack(eng.tokenizer, DATA)
# (label, method, anchor_tokens override or None for the configured default)
variants = [("anchor", "anchor", None), ("anchor0", "anchor", 0), ("anchor_pc", "anchor_pc", None),
            ("oracle", "oracle", None), ("oracle_anchor", "oracle_anchor", None), ("prophetkv", "prophetkv", None)]
res = {}
for task in tasks:
    exs = build_examples(task, eng.tokenizer, DATA, TaskConfig(n=n, docs=8, doc_tokens=512, seed=seed), hay)
    for ex in exs:
        t0 = time.time()
        prefix, ch, q = be.prepare(ex)
        budget = ex.max_tokens
        van = eng.fuse(prefix, ch, q, be.options("vanilla", None), max_tokens=1)
        layout = Layout(len(prefix), [len(c) for c in ch], len(q))
        rec = FusedCache(eng.num_layers, eng.num_kv_heads, eng.head_dim, layout.total, eng.dtype, eng.device)
        eng._assemble(rec, prefix, ch, layout, True)
        p, N = layout.prefix_len, layout.context_len
        vk, vv = van.cache.k[:, :, p:p + N], van.cache.v[:, :, p:p + N]
        rk, rv = rec.k[:, :, p:p + N], rec.v[:, :, p:p + N]
        dv = ((vv - rv).norm(dim=-1) / vv.norm(dim=-1).clamp_min(1e-6)).mean(dim=(0, 1))
        dk = ((vk - rk).norm(dim=-1) / vk.norm(dim=-1).clamp_min(1e-6)).mean(dim=(0, 1))
        ORACLE["scores"] = (dv + dk).float()
        ans = be.greedy(prefix, ch, q, be.options("vanilla", None), budget)
        vt, vlog = ans.text, ans.first_logits
        res.setdefault((task, "vanilla"), []).append((score_answer(ex.metric, vt, ex.answers), 0.0, True))
        for label, m, a in variants:
            opts = be.options(m, 0.15)
            if a is not None:
                opts = dataclasses.replace(opts, anchor_tokens=a)
            ans = be.greedy(prefix, ch, q, opts, budget)
            t, lg = ans.text, ans.first_logits
            res.setdefault((task, label), []).append((score_answer(ex.metric, t, ex.answers), kl_divergence(vlog, lg), t.strip() == vt.strip()))
        print(f"{task} {ex.id} {time.time()-t0:.0f}s", flush=True)
    for key in sorted(k for k in res if k[0] == task):
        r = res[key]
        print(f"  {key[1]:14s} score {statistics.mean(x[0] for x in r):.3f}  KL med {statistics.median(x[1] for x in r):.4f} mean {statistics.mean(x[1] for x in r):.4f}  same {sum(x[2] for x in r)}/{len(r)}", flush=True)
