"""vanilla: full prefill of the whole prompt, the cached chunks unused. The accuracy upper bound."""

from kvfuse.fusion.methods.base import FusionMethod, register


@register
class Vanilla(FusionMethod):
    name = "vanilla"
    full_prefill = True
