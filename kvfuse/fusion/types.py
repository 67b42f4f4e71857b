"""Data types shared by the engine, the methods and the callers."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from kvfuse.config import FusionMethodName, FusionRequestSettings, GenerationSettings
from kvfuse.kv_formats import QTensor, dequantize

_GEN_DEFAULTS = GenerationSettings()


@dataclass
class Layout:
    """Where each part of the prompt sits (global positions)."""

    prefix_len: int
    chunk_lens: list[int]
    question_len: int

    @property
    def context_start(self) -> int:
        return self.prefix_len

    @property
    def context_len(self) -> int:
        return sum(self.chunk_lens)

    @property
    def question_start(self) -> int:
        return self.prefix_len + self.context_len

    @property
    def total(self) -> int:
        return self.question_start + self.question_len

    def chunk_starts(self) -> list[int]:
        """Global start of each chunk."""
        starts, pos = [], self.prefix_len
        for n in self.chunk_lens:
            starts.append(pos)
            pos += n
        return starts


@dataclass
class ChunkKV:
    """One chunk's cache, computed alone at positions 0..n-1 (keys post-RoPE, convention "rope0").

    k, v: [num_layers, num_kv_heads, n, head_dim], any float dtype/device (the engine casts on assembly),
    or, read from a store in a quantized format, its codes and scales (kvfuse.kv_formats.QTensor; same
    `shape`). Either way `layer_kv` gives one layer as floats and `dequantized` the whole chunk.
    None for both: the chunk's tokens only, enough for a method that prefills everything (`vanilla`),
    so such a request never loads or rebuilds stored KV.
    """

    token_ids: list[int]
    k: torch.Tensor | QTensor | None = None
    v: torch.Tensor | QTensor | None = None
    # Computed after a context (store.precompute_context, FusionEngine.precompute_after) rather than as
    # the start of a sequence: its first tokens hold no attention sink, so `anchor` forces none of them.
    after_context: bool = False

    @property
    def has_kv(self) -> bool:
        return self.k is not None and self.v is not None

    @property
    def quantized(self) -> bool:
        return isinstance(self.k, QTensor)

    @property
    def layer_dtype(self) -> torch.dtype:
        """The dtype `layer_kv` gives when none is asked for: a float chunk's own, fp32 for a quantized one
        (what it is dequantized in)."""
        return torch.float32 if self.quantized else self.k.dtype

    def layer_kv(self, layer: int, device: torch.device | str, dtype: torch.dtype | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s K and V as floating [Hkv, n, D] tensors on `device`, in `dtype` (default
        `layer_dtype`). A quantized chunk's codes and scales are moved to `device` first and dequantized
        there, so only the smaller codes cross the bus (docs/DESIGN.md, "Storage")."""
        if not self.has_kv:
            raise ValueError("token ids only: this chunk has no KV")
        dtype = dtype or self.layer_dtype
        if self.quantized:
            return tuple(x.layer(layer).to(device, non_blocking=True).dequantize(dtype) for x in (self.k, self.v))
        return tuple(x[layer].to(device=device, dtype=dtype, non_blocking=True) for x in (self.k, self.v))

    def dequantized(self, dtype: torch.dtype | None = None) -> ChunkKV:
        """This chunk with floating k and v of every layer (in `dtype`, default `layer_dtype`), for what
        needs the whole chunk at once (samkv's block sources, a system prompt's prefix); a float chunk
        is returned as it is when no other dtype is asked for."""
        if not self.has_kv or (not self.quantized and dtype in (None, self.k.dtype)):
            return self
        return replace(self, k=dequantize(self.k, dtype or self.layer_dtype), v=dequantize(self.v, dtype or self.layer_dtype))

    def __len__(self) -> int:
        return len(self.token_ids)


_FUSION_DEFAULTS = FusionRequestSettings()


@dataclass
class FusionOptions:
    """Per-request fusion knobs, typed. Their names, bounds, descriptions and defaults are declared once, in
    config's FusionRequestSettings (docs/configuration.md, `fusion`); the HTTP request's `fusion` object
    (api/schemas.py FusionIn) derives from it, and the wire carries them as a dict of these names
    (wire/protocol.py QueryJob.fusion). tests/fusion/test_fusion_options.py holds the three together.
    Engine knobs (precompute batch size, attention blocks) are not here: they are config-only."""

    method: FusionMethodName = _FUSION_DEFAULTS.method
    recompute_ratio: float = _FUSION_DEFAULTS.recompute_ratio
    check_layer: int = _FUSION_DEFAULTS.check_layer
    smooth_window: int = _FUSION_DEFAULTS.smooth_window
    edge_tokens: int = _FUSION_DEFAULTS.edge_tokens
    edge_tokens_end: int = _FUSION_DEFAULTS.edge_tokens_end
    anchor_tokens: int = _FUSION_DEFAULTS.anchor_tokens
    evict_capacity: int = _FUSION_DEFAULTS.evict_capacity
    samkv_update: Literal["fusion", "overwrite"] = _FUSION_DEFAULTS.samkv_update
    samkv_min_p: float = _FUSION_DEFAULTS.samkv_min_p
    samkv_cross_cut: bool = _FUSION_DEFAULTS.samkv_cross_cut
    link_tokens: int = _FUSION_DEFAULTS.link_tokens
    cold_chunks: Literal["auto", "compute", "full_prefill"] = _FUSION_DEFAULTS.cold_chunks


def request_knobs(fusion_settings: FusionRequestSettings) -> dict:
    """The per-request knobs of config.fusion as FusionOptions' keyword arguments (its engine knobs left
    out): the defaults a request or a benchmark run starts from."""
    return {name: getattr(fusion_settings, name) for name in FusionRequestSettings.model_fields}


@dataclass
class GenerationOptions:
    max_tokens: int = _GEN_DEFAULTS.max_tokens
    temperature: float = _GEN_DEFAULTS.temperature
    top_p: float = _GEN_DEFAULTS.top_p
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: none; n: each kept token's log-probability and the n most likely
    # OpenAI's, applied by the sampler (engine/sampling.py): token id -> bias, and the output-token penalties
    logit_bias: dict[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # response_format: the answer's grammar, serialised (engine/grammar.py compiles it with the tokenizer)
    grammar: str | None = None


@dataclass
class FusedPrefill:
    """The result of `FusionEngine.fuse`: a cache ready to decode from and the first-token logits."""

    cache: Any  # kvfuse.fusion.engine.fused_cache.FusedCache
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
    stats: dict[str, int] = field(default_factory=dict)  # the fused prefill's stats (FusedPrefill.stats)
    logprobs: list = field(default_factory=list)  # per kept token (fusion/engine/logprobs.py), when asked for
