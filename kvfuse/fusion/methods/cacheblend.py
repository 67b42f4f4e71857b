"""cacheblend: layers before the check layer (default 1, i.e. layer 0) run in full; at the check layer
the top round(r * N) context tokens by ||V_new - V_cached|| are recomputed in the later layers.

The check layer's K/V of every context token come out exact from the full layers before it and are
written to the cache (they are computed anyway to measure the deviation)."""

import torch

from kvfuse.fusion.methods import scoring
from kvfuse.fusion.methods.base import CheckLayerMethod, register
from kvfuse.fusion.methods.selection import SelectionContext


@register
class CacheBlend(CheckLayerMethod):
    name = "cacheblend"

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        return scoring.top_k(ctx.value_deviation(), ctx.budget)
