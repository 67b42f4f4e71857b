"""epic (LegoLink): recompute the first `edge_tokens` and last `edge_tokens_end` tokens of each chunk.

The selection is fixed by the chunk structure, so its size is the edge count, not round(r * N).
"""

import torch

from kvfuse.fusion.methods.base import FusionMethod, register
from kvfuse.fusion.methods.selection import SelectionContext


@register
class Epic(FusionMethod):
    name = "epic"

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        return ctx.chunk_edges(ctx.options.edge_tokens, ctx.options.edge_tokens_end)
