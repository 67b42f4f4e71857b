"""a3 (A³, "Attention-Aware Accurate KV Cache Fusion"), as in the paper (Eq. 3-5) and its code:

layer 0 runs in full for every token; at the check layer (default 1) the question's attention onto each
context token, softmax(q_j K_true^T / sqrt(d)), is summed over question tokens and heads, smoothed with a
width-`smooth_window` average pool, and the top round(r * N) context tokens plus every question token are
recomputed in the later layers; the check layer's K/V are exact for all tokens (Eq. 4).

Departure: the paper sizes the selection as r * n with n the whole input; here n is the context only
(the prefix is exact and the question always recomputed), the project-wide definition of r.
"""

import torch

from kvfuse.fusion.methods import scoring
from kvfuse.fusion.methods.base import CheckLayerMethod, register
from kvfuse.fusion.methods.selection import SelectionContext


@register
class A3(CheckLayerMethod):
    name = "a3"

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        scores = ctx.question_attention().sum(dim=(0, 1))
        return scoring.top_k(scoring.smooth(scores, ctx.options.smooth_window), ctx.budget)
