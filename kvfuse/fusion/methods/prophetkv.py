"""prophetkv (ProphetKV): stage I runs only the question through every layer over the position-recovered
cache and scores each context token by the question's attention onto it (mean over question tokens and
heads per layer, Φ̂'), fused by a uniform mean over layers (Eq. 7); stage II recomputes the top
round(r * N) context tokens plus the question in one pass through all layers (Algorithm 1).

Choices the paper leaves open (see the notes): the question rows are the whole question part (question
text + template tail); the softmax runs over every key a row may see (prefix, context, earlier question
tokens) and only the context columns are scored; the stage-I question K/V are discarded.
"""

import torch

from kvfuse.fusion import scoring
from kvfuse.fusion.methods.base import FusionMethod, register
from kvfuse.fusion.selection import SelectionContext


@register
class ProphetKV(FusionMethod):
    name = "prophetkv"

    def probe_layers(self, num_layers: int) -> int:
        return num_layers  # stage I runs the question through every layer

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        return scoring.top_k(ctx.probe_question_attention().mean(dim=0), ctx.budget)
