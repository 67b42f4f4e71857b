"""What the engine core needs of the engine that fuses prefills (kvfuse.fusion.FusionEngine), named here as
a Protocol: the fusion engine builds on the core's KV memory and runner, so the core naming the fusion
engine's class would close an import cycle (docs/DESIGN.md, "Decoding: the engine core")."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Protocol

import torch

from kvfuse.fusion.engine.detokenize import Tokenizer
from kvfuse.fusion.engine.fused_cache import FusedCache
from kvfuse.fusion.types import ChunkKV, FusedPrefill, FusionOptions

if TYPE_CHECKING:
    from kvfuse.fusion.model.transformer import Transformer


class FusingEngine(Protocol):
    """The model's layers, where they run, how text ends, and the fused prefill a layer at a time."""

    tf: Transformer
    num_layers: int
    device: torch.device
    tokenizer: Tokenizer
    stop_token_ids: set[int]
    stop_strings: tuple[str, ...]

    def fuse_steps(self, prefix: ChunkKV | None, chunks: list[ChunkKV], question_ids: list[int],
                   options: FusionOptions | None = None, *, max_tokens: int = 0,
                   new_cache: Callable[[int], FusedCache] | None = None) -> Generator[int, None, FusedPrefill]:
        """kvfuse.fusion.FusionEngine.fuse_steps."""
        ...
