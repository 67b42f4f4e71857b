"""prophetkv (ProphetKV): stage I runs only the question through every layer over the position-recovered
cache and scores each context token by the question's attention onto it (mean over question tokens and
heads per layer, Φ̂'), fused by a uniform mean over layers (Eq. 7); stage II recomputes the top
round(r * N) context tokens plus the question in one pass through all layers (Algorithm 1).

Choices the paper leaves open (see the notes): the question rows are the whole question part (question
text + template tail); the softmax runs over every key a row may see (prefix, context, earlier question
tokens) and only the context columns are scored; the stage-I question K/V are discarded.
"""

import torch

from kvfuse.fusion.methods import scoring
from kvfuse.fusion.methods.base import FusionMethod, register
from kvfuse.fusion.methods.selection import SelectionContext


@register
class ProphetKV(FusionMethod):
    name = "prophetkv"

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        per_layer = ctx.question_probe(range(ctx.tf.num_layers)).mean(dim=1)  # [L, N]: mean over heads
        return scoring.top_k(per_layer.mean(dim=0), ctx.budget)
