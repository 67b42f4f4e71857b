"""The method interface and registry.

A method decides which context tokens are recomputed. The engine does everything else: assembles the
cache (position recovery unless `recover_positions` is False), runs the first `full_layers()` layers in
full for every context and question row, asks `select()` for context indices (0..N-1), then recomputes
those rows plus every question row through the remaining layers, attending over the whole fused cache.

A new method is one module in this package with a subclass decorated by `@register`; modules here are
imported automatically. Build `select()` from the signals of `SelectionContext` and `kvfuse.fusion.scoring`.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvfuse.fusion.selection import SelectionContext
from kvfuse.fusion.types import FusionOptions

_REGISTRY: dict[str, type[FusionMethod]] = {}


class FusionMethod:
    name: ClassVar[str]
    recover_positions: ClassVar[bool] = True  # rotate cached keys to their global positions
    full_prefill: ClassVar[bool] = False  # ignore the cached chunks: prefill the whole prompt

    def full_layers(self, options: FusionOptions, num_layers: int) -> int:
        """Layers run in full for all context rows before `select()` (their hidden states are then exact)."""
        return 0

    def probe_layers(self, num_layers: int) -> int:
        """Layers a question-only probe runs inside `select()` (0: none); the arithmetic floor counts it."""
        return 0

    def stale_bias(self, options: FusionOptions) -> float:
        """Added to the question's and the generated tokens' attention logits onto the context keys that
        were not recomputed (0: none). Every paper method keeps 0."""
        return 0.0

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        """Context indices (0..N-1) to recompute; question rows are always recomputed."""
        return torch.empty(0, dtype=torch.long, device=ctx.ids.device)


class CheckLayerMethod(FusionMethod):
    """A method that runs every layer before `options.check_layer` in full and selects from the check
    layer's exact signals (A³, CacheBlend)."""

    def full_layers(self, options: FusionOptions, num_layers: int) -> int:
        return options.check_layer


def register(cls: type[FusionMethod]) -> type[FusionMethod]:
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"fusion method {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def registry() -> dict[str, type[FusionMethod]]:
    return _REGISTRY
