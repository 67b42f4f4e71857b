"""The method interface and registry.

A method decides which context tokens are recomputed. The engine does everything else: assembles the
cache (position recovery unless `recover_positions` is False), runs the first `full_layers()` layers in
full for every context and question row, asks `select()` for context indices (0..N-1), then recomputes
those rows plus every question row through the remaining layers, attending over the whole fused cache,
from where `recompute_start()` says.

A new method is one module in this package with a subclass decorated by `@register`; modules here are
imported automatically. Build `select()` from the signals of `SelectionContext` and `kvfuse.fusion.methods.scoring`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from kvfuse.fusion.errors import MethodRefusedError
from kvfuse.fusion.methods.selection import SelectionContext
from kvfuse.fusion.model.transformer import Rows
from kvfuse.fusion.types import ChunkKV, FusionOptions

_REGISTRY: dict[str, type[FusionMethod]] = {}


class FusionMethod:
    name: ClassVar[str]
    recover_positions: ClassVar[bool] = True  # rotate cached keys to their global positions
    full_prefill: ClassVar[bool] = False  # ignore the cached chunks: prefill the whole prompt
    own_pipeline: ClassVar[bool] = False  # builds its own cache and prefill (`pipeline`), e.g. a sparse one

    def pipeline(self, engine, prefix, chunks, question_ids, options, max_tokens, new_cache):
        """Only for `own_pipeline` methods: the whole fused prefill, as `FusionEngine.fuse_steps` (a
        generator yielding the rows each layer ran, returning the FusedPrefill). `chunks` may be
        ChunkKV or the method's own sources (samkv: kvfuse.fusion.methods.sparse.source); `new_cache(capacity)`
        gives the cache the prefill leaves behind (in the engine core, a view of the request's extent)."""
        raise NotImplementedError

    # Why the method cannot serve a model with sliding-window layers (None: it can; docs/models.md lists it).
    window_refusal: ClassVar[str | None] = None
    # What it refuses of such a model when it refuses only some requests (docs/models.md; `refusal` decides).
    window_note: ClassVar[str | None] = None

    def refusal(self, engine: Any, options: FusionOptions) -> str | None:
        """Why the method cannot compute `engine`'s model exactly for these options (None: it can).
        Default: `window_refusal` when any layer has a sliding window."""
        if self.window_refusal and any(w is not None for w in engine.tf.windows):
            return self.window_refusal
        return None

    def check_serves(self, engine: Any, options: FusionOptions) -> None:
        """Raise MethodRefusedError (a request error: 422) when `refusal` gives a reason."""
        reason = self.refusal(engine, options)
        if reason:
            raise MethodRefusedError(f"fusion method {self.name!r} cannot serve {engine.family.model_type} "
                                     f"model: {reason}")

    @classmethod
    def load_artifacts(cls, engine: Any, settings: Any) -> None:
        """Load what the method trained for `engine`'s model into `engine.artifacts` (at engine start)."""

    def prepare(self, engine: Any, chunks: list[ChunkKV], options: FusionOptions) -> list[ChunkKV]:
        """The chunks the engine lays out, before anything else runs. Default: as given. A method that
        puts tokens of its own between the chunks (kvlink's link tokens) returns them as extra chunks."""
        return chunks

    def tokens_per_chunk(self, options: FusionOptions) -> int:
        """Cache rows the method adds after each chunk (kvlink's link slots): the scheduler counts them
        against the model context and the KV budget. Default: none."""
        return 0

    def full_layers(self, options: FusionOptions, num_layers: int) -> int:
        """Layers run in full for all context rows before `select()` (their hidden states are then exact)."""
        return 0

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        """Context indices (0..N-1) to recompute; question rows are always recomputed."""
        return torch.empty(0, dtype=torch.long, device=ctx.ids.device)

    def recompute_start(self, ctx: SelectionContext, local: torch.Tensor, rows: Rows) -> tuple[torch.Tensor, int]:
        """(hidden [1, R, hidden], layer): where the recompute of `rows` starts. `local` indexes the rows
        among the context and question rows (0..N+Qn-1). Default: the output of the full layers, or the
        embeddings when none ran."""
        if ctx.hidden is not None:
            return ctx.hidden[:, local], ctx.check_layer
        return ctx.tf.embed(ctx.ids[rows.positions]), 0


class CheckLayerMethod(FusionMethod):
    """A method that runs every layer before `options.check_layer` in full and selects from the check
    layer's exact signals (A³, CacheBlend)."""

    def full_layers(self, options: FusionOptions, num_layers: int) -> int:
        return options.check_layer

    def recompute_start(self, ctx: SelectionContext, local: torch.Tensor, rows: Rows) -> tuple[torch.Tensor, int]:
        """The check layer's q/k/v of every row are exact (the layers before it ran in full) and were
        computed for `select()`: every row's K/V is kept there (A³ Eq. 4), and only the recomputed rows
        go on, from the check layer's attention."""
        q, k, v = ctx.check_projections()
        layer, tf = ctx.check_layer, ctx.tf
        ctx.cache.write(layer, ctx.rows_all().positions, k, v)
        h = tf.finish(layer, ctx.hidden[:, local], tf.attend(ctx.cache, layer, rows, q[:, :, local]))
        return h, layer + 1


def register(cls: type[FusionMethod]) -> type[FusionMethod]:
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"fusion method {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def registry() -> dict[str, type[FusionMethod]]:
    return _REGISTRY
