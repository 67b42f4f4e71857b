"""full_reuse: concatenate the chunk caches as stored (every chunk keeps positions 0..n-1); prefill only
the question. The lower bound: shows what position recovery buys."""

from kvfuse.fusion.methods.base import FusionMethod, register


@register
class FullReuse(FusionMethod):
    name = "full_reuse"
    recover_positions = False
