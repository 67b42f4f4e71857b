"""The decoder layers run over the fused cache, for any subset of query rows, and batched decode steps.

Why not the model's own forward: the HF attention module appends to its cache and cannot overwrite
rows in the middle, so selective recomputation runs the layers here. Norms, projections, MLP and the
rotary module are the model's; only attention is written out.

Attention: `Rows` are query rows at sorted global positions; a row attends causally by position over
the fused cache, i.e. row i sees keys 0..positions[i]. Which kernel does that for which row set (the
kernel's causal mask, lower-right causal for contiguous rows, the blocked CPU kernel, FlexAttention on
CUDA, the dense [rows, keys] mask as the reference) is kvfuse/fusion/model/attention.py's choice, planned once
per `Rows` (one phase: the full layers, the probe, the recompute) and shared by every layer.

On CUDA the calls where every row sees every key (`attend_all`: a decode step, the last prompt row)
keep off the cuDNN attention backend: it builds an execution plan for every new key length, which a
decode step (one more key each time) would pay on every step; the flash kernel needs none. The
prefill phases keep it: on long prompts its attention ran about twice as fast as flash
(docs/results/gpu/README.md).

Decoding lives apart: the service's batched step over the worker's KV pool in `model_runner.py`, the
per-cache step (each sequence over its own `FusedCache`) in `cache_decode.py`; both reuse `project`,
`finish` and `logits` from here.

Only the last prompt row feeds the logits, so the model's last layer writes every row's K/V but runs
attention and MLP for the last row alone (`Transformer.layer(..., last_only=True)`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvfuse.fusion.engine.kv_memory import FusedCache
from kvfuse.fusion.errors import UnsupportedModelError
from kvfuse.fusion.model import attention_cpu
from kvfuse.fusion.model.attention import Attention
from kvfuse.fusion.model.rope import Rope, apply_rope

# Every row sees every key (decode): no cuDNN, which plans anew for each key length (module docstring).
_NO_PLAN_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")


class Rows:
    """Query rows at sorted global positions, with what every layer shares for them: cos/sin, and what
    the attention path plans once (`plan`; the dense mask by position only if the dense path asks)."""

    def __init__(self, positions: torch.Tensor, rope: Rope, dtype: torch.dtype) -> None:
        self.positions = positions
        self.dtype = dtype
        self.count = int(positions.numel())
        self.cos, self.sin = (t.unsqueeze(1) for t in rope.cos_sin(positions, dtype))  # [1, 1, R, D]
        self.stop = int(positions[-1]) + 1  # keys [0, stop) are all any row reads
        self.contiguous = self.stop - int(positions[0]) == self.count  # the last `count` of the keys
        self._mask: torch.Tensor | None = None
        self.plan: object | None = None  # an attention path's per-phase state, built on first use

    @property
    def mask(self) -> torch.Tensor | None:
        """The causal mask by position [R, stop], additive in the compute dtype (so the kernel never
        converts it); None for rows 0..stop-1 (the kernel's own causal mask). Built on first use."""
        if self._mask is None and self.count != self.stop:
            self._mask = attention_cpu.causal_mask(self.positions, 0, self.stop, self.dtype)
        return self._mask


class Transformer:
    """The decoder of a Llama/Mistral/Qwen2-family model, run layer by layer on `Rows`.

    attention_block_rows: rows per block of the blocked CPU kernel (0: none); sparse_attention: scattered
    rows through FlexAttention on CUDA (kvfuse/fusion/model/attention.py)."""

    def __init__(self, model: torch.nn.Module, attention_block_rows: int = 0, sparse_attention: bool = True) -> None:
        base = model.model
        self.model = model
        self.config = model.config
        self.embed_tokens = base.embed_tokens
        self.layers = list(base.layers)
        self.norm = base.norm
        self.lm_head = model.lm_head
        self.num_layers = len(self.layers)
        cfg = self.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self._check_structure()
        self.scale = float(getattr(self.layers[0].self_attn, "scaling", self.head_dim**-0.5))
        weight = self.embed_tokens.weight
        self.dtype = weight.dtype
        self.rope = Rope(base.rotary_emb, cfg, weight.device)
        self.attention = Attention(self.scale, weight.device, attention_block_rows, sparse_attention)

    def _check_structure(self) -> None:
        for i, layer in enumerate(self.layers):
            missing = [p for p in _LAYER_PARTS if not hasattr(layer, p)]
            missing += [f"self_attn.{p}" for p in _ATTN_PARTS if not hasattr(layer.self_attn, p)]
            if missing:
                raise UnsupportedModelError(f"decoder layer {i} lacks {missing}: not a Llama/Mistral/Qwen2 layout")
            for extra in ("q_norm", "k_norm"):
                if hasattr(layer.self_attn, extra):
                    raise UnsupportedModelError(f"attention with {extra} is not supported")
        if getattr(self.config, "attn_logit_softcapping", None):
            raise UnsupportedModelError("attention logit soft-capping is not supported")

    # -- per-layer pieces -------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [R] -> hidden [1, R, hidden]."""
        return self.embed_tokens(ids.view(1, -1))

    def project(self, layer: int, h: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Hidden [B, R, hidden] -> q [B, H, R, D], k/v [B, Hkv, R, D], q and k rotated by cos/sin
        (broadcastable to [B, 1, R, D]: the rows' positions)."""
        mod = self.layers[layer]
        attn = mod.self_attn
        x = mod.input_layernorm(h)
        b, r = h.shape[:2]
        q = attn.q_proj(x).view(b, r, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, r, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, r, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, cache: FusedCache, layer: int, rows: Rows, q: torch.Tensor) -> torch.Tensor:
        """Attention of the rows q [1, H, R, D] over the fused cache, each row causally by global
        position: [1, H, R, D]."""
        return self.attention(q, cache.keys(layer, rows.stop), cache.values(layer, rows.stop), rows)

    def attend_all(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Rows q [1, H, R, D] that all see every key of k/v [1, Hkv, T, D]: [1, H, R, D].

        No mask, and the query heads sharing a KV head are folded into the rows of one call, so each
        key is read once per KV head rather than once per query head (a decode step is bound by
        reading the cache)."""
        _, h, r, d = q.shape
        hkv = k.shape[1]
        if q.device.type == "cuda":
            with sdpa_kernel(_NO_PLAN_BACKENDS):
                out = F.scaled_dot_product_attention(q.reshape(1, hkv, (h // hkv) * r, d), k, v, scale=self.scale)
            return out.reshape(1, h, r, d)
        out = F.scaled_dot_product_attention(q.reshape(1, hkv, (h // hkv) * r, d), k, v, scale=self.scale)
        return out.reshape(1, h, r, d)  # CUDA kernels may return it strided

    def finish(self, layer: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Attention output [B, H, R, D] -> o_proj + residual, then post-attention norm + MLP + residual."""
        mod = self.layers[layer]
        b, _, r, _ = attn_out.shape
        h = h + mod.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, r, -1))
        return h + mod.mlp(mod.post_attention_layernorm(h))

    def layer(self, cache: FusedCache, layer: int, h: torch.Tensor, rows: Rows, last_only: bool = False) -> torch.Tensor:
        """One decoder layer for the rows: their K/V written into the cache, then attention + MLP.
        last_only: run attention and MLP for the last row alone (it sees every key up to its position)."""
        q, k, v = self.project(layer, h, rows.cos, rows.sin)
        cache.write(layer, rows.positions, k, v)
        if last_only:
            keys, values = cache.keys(layer, rows.stop), cache.values(layer, rows.stop)
            return self.finish(layer, h[:, -1:], self.attend_all(q[:, :, -1:], keys, values))
        return self.finish(layer, h, self.attend(cache, layer, rows, q))

    def run(self, cache: FusedCache, h: torch.Tensor, rows: Rows, layers: range) -> torch.Tensor:
        """Run the rows through `layers`. When they end at the model's last layer only the last row's
        output is computed there (all the logits need): the result is then [1, 1, hidden]."""
        for i in layers:
            h = self.layer(cache, i, h, rows, last_only=i == self.num_layers - 1)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden [B, hidden] -> float32 logits [B, vocab]."""
        return self.lm_head(self.norm(h)).float()
