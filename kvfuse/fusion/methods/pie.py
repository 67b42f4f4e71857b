"""pie: position recovery only (keys re-rotated to their global positions); prefill only the question."""

from kvfuse.fusion.methods.base import FusionMethod, register


@register
class Pie(FusionMethod):
    name = "pie"
