"""Data types shared by the engine, the methods and the callers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kvfuse.config import FusionSettings, GenerationSettings

_FUSION_DEFAULTS = FusionSettings()
_GEN_DEFAULTS = GenerationSettings()


@dataclass
class ChunkKV:
    """One chunk's cache, computed alone at positions 0..n-1 (keys post-RoPE, convention "rope0").

    k, v: [num_layers, num_kv_heads, n, head_dim], any dtype/device (the engine casts on assembly).
    None for both: the chunk's tokens only, enough for a method that prefills everything (`vanilla`),
    so such a request never loads or rebuilds stored KV.
    """

    token_ids: list[int]
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @property
    def has_kv(self) -> bool:
        return self.k is not None and self.v is not None

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class FusionOptions:
    """Per-request fusion knobs; defaults come from config.fusion."""

    method: str = _FUSION_DEFAULTS.method
    recompute_ratio: float = _FUSION_DEFAULTS.recompute_ratio
    check_layer: int = _FUSION_DEFAULTS.check_layer
    smooth_window: int = _FUSION_DEFAULTS.smooth_window
    edge_tokens: int = _FUSION_DEFAULTS.edge_tokens
    edge_tokens_end: int = _FUSION_DEFAULTS.edge_tokens_end
    anchor_tokens: int = _FUSION_DEFAULTS.anchor_tokens
    stale_logit_bias: float = _FUSION_DEFAULTS.stale_logit_bias


@dataclass
class GenerationOptions:
    max_tokens: int = _GEN_DEFAULTS.max_tokens
    temperature: float = _GEN_DEFAULTS.temperature
    top_p: float = _GEN_DEFAULTS.top_p
    seed: int | None = None
    stop: list[str] = field(default_factory=list)


@dataclass
class FusedPrefill:
    """The result of `FusionEngine.fuse`: a cache ready to decode from and the first-token logits."""

    cache: Any  # kvfuse.fusion.cache.FusedCache
    logits: torch.Tensor  # [vocab], float32, last prompt position
    selected: torch.Tensor  # LongTensor of recomputed context positions (global, sorted)
    stats: dict[str, int]
    timings: dict[str, float]


@dataclass
class TokenDelta:
    text: str


FinishReason = Literal["stop", "length", "cancelled"]


@dataclass
class GenerationResult:
    text: str
    finish_reason: FinishReason
    usage: dict[str, int]
    timings: dict[str, float]
    token_ids: list[int] = field(default_factory=list)
    decode_steps: int = 0  # forward steps after the first token (one more than tokens kept when EOS ended it)
