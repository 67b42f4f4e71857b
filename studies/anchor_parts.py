"""Study: which part of `anchor` earns its place? Each part taken away in turn, on the same examples.

`anchor` differs from `prophetkv` (question attention averaged over every layer, nothing else) in four
parts: chunk-start anchors, a middle-to-deep layer window, per-head renormalisation and a width-3 spread.
Each variant drops one of them; `prophetkv` drops all four; `cacheblend` is there for its TTFT. Every variant runs on the same fused inputs as
vanilla (the fidelity benchmark's examples, prefix and chunks precomputed once per example) and is scored
and compared with vanilla by the benchmark's own aggregation (score / vanilla with its paired bootstrap
interval, examples above and below vanilla, same answer, first-token KL).

Usage: python studies/anchor_parts.py TASKS N [SEED] [DOCS] [DOC_TOKENS] [JSON]
  (the system prompt is config `model.system_prompt`, e.g. KVFUSE_MODEL__SYSTEM_PROMPT)
"""

import dataclasses

import torch
from study_tools import DATA, outcome, report_outcomes, task_args

from kvfuse.bench.engine_backend import EngineBackend
from kvfuse.bench.fidelity import Outcome
from kvfuse.bench.tasks import Haystack, TaskConfig, build_examples
from kvfuse.config import get_settings
from kvfuse.fusion.methods import anchor as A
from kvfuse.fusion.methods.base import register

RATIO = 0.15


@register
class AllLayers(A.Anchor):
    name = "anchor_all_layers"
    window = (0.0, 1.0)


@register
class NoSpread(A.Anchor):
    name = "anchor_no_spread"
    neighbours = 1


@register
class NoNorm(A.Anchor):
    """Votes are the raw attention shares (a head that looks at sinks or the prefix votes less)."""

    name = "anchor_no_norm"

    def select(self, ctx):
        n, budget = ctx.num_context, ctx.budget
        chosen = torch.zeros(n, dtype=torch.bool, device=ctx.ids.device)
        anchors = ctx.chunk_edges(ctx.options.anchor_tokens, 0)[:budget]
        chosen[anchors] = True
        rest = budget - int(anchors.numel())
        if rest <= 0:
            return anchors
        head_attn = ctx.question_probe(A.layer_window(ctx.tf.num_layers, *self.window))
        scores = A.spread(head_attn.mean(dim=(0, 1)), self.neighbours).masked_fill(chosen, float("-inf"))
        chosen[torch.topk(scores, rest, sorted=False).indices] = True
        return chosen.nonzero().view(-1)


# label -> (registered method, FusionOptions overrides)
VARIANTS = {
    "anchor": ("anchor", {}),
    "anchor, no anchors": ("anchor", {"anchor_tokens": 0}),
    "anchor, all layers": ("anchor_all_layers", {}),
    "anchor, no head norm": ("anchor_no_norm", {}),
    "anchor, no spread": ("anchor_no_spread", {}),
    "prophetkv": ("prophetkv", {}),
    "cacheblend": ("cacheblend", {}),
}

tasks, n, seed, docs, doc_tokens, out_json = task_args()
be = EngineBackend(get_settings(), max_tokens=None)
cfg = TaskConfig(n=n, docs=docs, doc_tokens=doc_tokens, seed=seed)
hay = Haystack(be.tokenizer, DATA)
outcomes: list[Outcome] = []
for task in tasks:
    for ex in build_examples(task, be.tokenizer, DATA, cfg, hay):
        prefix, chunks, q = be.prepare(ex)
        ref = None
        plan = [("vanilla", "vanilla", {}, None)] + [(label, m, o, RATIO) for label, (m, o) in VARIANTS.items()]
        for label, method, overrides, ratio in plan:
            opts = dataclasses.replace(be.options(method, ratio), **overrides)
            result = be.greedy(prefix, chunks, q, opts, ex.max_tokens)
            ref = result.first_logits if ref is None else ref
            outcomes.append(outcome(ex, label, ratio, result, ref))
        print(ex.id, [(o.method, round(o.score, 2), round(o.kl_vs_vanilla, 4)) for o in outcomes[-len(plan):]],
              flush=True)
report_outcomes(outcomes, out_json)
