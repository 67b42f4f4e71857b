"""a3 (A³, "Attention-Aware Accurate KV Cache Fusion"), as in the paper (Eq. 3-5) and its code:

layer 0 runs in full for every token; at the check layer (default 1) the question's attention onto each
context token, softmax(q_j K_true^T / sqrt(d)), is summed over question tokens and heads, smoothed with a
width-`smooth_window` average pool, and the top round(r * N) context tokens plus every question token are
recomputed in the later layers; the check layer's K/V are exact for all tokens (Eq. 4).

Departure: the paper sizes the selection as r * n with n the whole input; here n is the context only
(the prefix is exact and the question always recomputed), the project-wide definition of r.

Sliding-window models: the signal is the question's attention at the check layer, which on a local
layer reaches only the last `window` keys; the selection would then be the window's tokens whatever the
question asks. So a3 refuses a check layer whose window can hide context (it names the global layers
to use instead); on a global check layer it runs as written (Gemma 2's default check layer 1 is global).
"""

from typing import Any

import torch

from kvfuse.fusion.methods import scoring
from kvfuse.fusion.methods.base import CheckLayerMethod, register
from kvfuse.fusion.methods.selection import SelectionContext


@register
class A3(CheckLayerMethod):
    name = "a3"
    window_note = ("refuses a check layer whose sliding window can hide context (its question attention sees only "
                   "the window); a global check layer serves")

    def refusal(self, engine: Any, options) -> str | None:
        windows = engine.tf.windows
        layer = options.check_layer
        window = windows[layer] if 0 <= layer < len(windows) else None
        if window is None or window >= engine.max_context_tokens:
            return None
        global_layers = [i for i, w in enumerate(windows) if w is None]
        fix = (f"set fusion.check_layer to a global layer ({', '.join(map(str, global_layers[:8]))})"
               if global_layers else "this model has no global layer")
        return (f"check layer {layer} is a sliding-window layer (window {window}): the question's attention "
                f"there reaches only its last {window} keys, not the context A³ selects from; {fix}")

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        scores = ctx.question_attention().sum(dim=(0, 1))
        return scoring.top_k(scoring.smooth(scores, ctx.options.smooth_window), ctx.budget)
