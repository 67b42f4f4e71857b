"""A layer loop over the model's own modules that can run any subset of query rows.

The HF attention module appends to its cache and cannot overwrite rows in the middle, so selective
recomputation runs the decoder layers here: norms, projections, MLP and the rotary module are the
model's; attention is `scaled_dot_product_attention` over the fused cache (GQA via `enable_gqa`).

`Rows` holds what every layer shares for one set of query rows: positions, cos/sin and the attention
blocks with their masks, built once per phase and never per layer. Rows are processed in blocks sorted
by position; each block reads keys only up to its last row's position, so masked-out keys beyond the
block are never touched (close to the causal work of the rows themselves).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvfuse.fusion.cache import FusedCache
from kvfuse.fusion.errors import UnsupportedModelError
from kvfuse.fusion.rope import Rope, apply_rope

_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass
class Block:
    start: int  # row range [start, stop) within Rows
    stop: int
    key_len: int  # keys [0, key_len) are read
    mask: torch.Tensor | None  # additive [rows, key_len] (0 or -inf); None = all keys visible
    causal: bool  # rows are exactly positions 0..key_len-1: the kernel's own causal mask


class Rows:
    """Query rows at sorted global positions, with per-phase state shared by every layer."""

    def __init__(self, positions: torch.Tensor, rope: Rope, dtype: torch.dtype, block_rows: int) -> None:
        self.positions = positions
        self.count = int(positions.numel())
        self.cos, self.sin = (t.unsqueeze(1) for t in rope.cos_sin(positions, dtype))  # [1, 1, R, D]
        first, last = int(positions[0]), int(positions[-1])
        self.contiguous = last - first + 1 == self.count
        self.start = first
        self.blocks = self._blocks(block_rows, dtype)

    def _blocks(self, block_rows: int, dtype: torch.dtype) -> list[Block]:
        pos = self.positions
        if self.contiguous and self.start == 0:
            return [Block(0, self.count, self.count, None, True)]
        blocks = []
        for a in range(0, self.count, block_rows):
            b = min(a + block_rows, self.count)
            key_len = int(pos[b - 1]) + 1
            mask = None
            if int(pos[a]) < key_len - 1:  # some row must not see the block's last keys
                hidden = pos[a:b, None] < torch.arange(key_len, device=pos.device)[None, :]
                # additive, in the compute dtype: the kernel would convert a bool mask on every call
                mask = torch.zeros(hidden.shape, dtype=dtype, device=pos.device).masked_fill_(hidden, float("-inf"))
            blocks.append(Block(a, b, key_len, mask, False))
        return blocks


class Transformer:
    """The decoder of a Llama/Mistral/Qwen2-family model, run layer by layer on `Rows`."""

    def __init__(self, model: torch.nn.Module) -> None:
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

    def project(self, layer: int, h: torch.Tensor, rows: Rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Hidden [1, R, hidden] -> q [1, H, R, D], k/v [1, Hkv, R, D] (q and k rotated to the rows' positions)."""
        mod = self.layers[layer]
        attn = mod.self_attn
        x = mod.input_layernorm(h)
        r = h.shape[1]
        q = attn.q_proj(x).view(1, r, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(1, r, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(1, r, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, rows.cos, rows.sin), apply_rope(k, rows.cos, rows.sin), v

    @staticmethod
    def write_kv(cache: FusedCache, layer: int, rows: Rows, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite the rows' K/V in place in the fused cache."""
        if rows.contiguous:
            cache.k[layer, :, rows.start : rows.start + rows.count] = k[0]
            cache.v[layer, :, rows.start : rows.start + rows.count] = v[0]
        else:
            cache.k[layer].index_copy_(1, rows.positions, k[0])
            cache.v[layer].index_copy_(1, rows.positions, v[0])

    def attend(self, cache: FusedCache, layer: int, rows: Rows, q: torch.Tensor) -> torch.Tensor:
        """Attention of the rows over the fused cache, each row causally by global position: [1, R, H*D]."""
        outs = []
        for b in rows.blocks:
            qb = q[:, :, b.start : b.stop]
            kb, vb = cache.keys(layer, b.key_len), cache.values(layer, b.key_len)
            outs.append(F.scaled_dot_product_attention(
                qb, kb, vb, attn_mask=b.mask, is_causal=b.causal, scale=self.scale, enable_gqa=True))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return out.transpose(1, 2).reshape(1, rows.count, self.num_heads * self.head_dim)

    def finish(self, layer: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """o_proj + residual, then post-attention norm + MLP + residual."""
        mod = self.layers[layer]
        h = h + mod.self_attn.o_proj(attn_out)
        return h + mod.mlp(mod.post_attention_layernorm(h))

    def layer(self, cache: FusedCache, layer: int, h: torch.Tensor, rows: Rows) -> torch.Tensor:
        q, k, v = self.project(layer, h, rows)
        self.write_kv(cache, layer, rows, k, v)
        return self.finish(layer, h, self.attend(cache, layer, rows, q))

    def run(self, cache: FusedCache, h: torch.Tensor, rows: Rows, layers: range) -> torch.Tensor:
        """Run the rows through `layers`. When they end at the model's last layer, only the last row's
        output is needed (for the logits): that layer writes every row's K/V but runs attention and
        MLP for the last row alone, and the result is [1, 1, hidden]."""
        for i in layers:
            if i == self.num_layers - 1 and rows.count > 1:
                q, k, v = self.project(i, h, rows)
                self.write_kv(cache, i, rows, k, v)
                last = int(rows.positions[-1]) + 1  # the last row sees every key up to its position
                out = F.scaled_dot_product_attention(q[:, :, -1:], cache.keys(i, last), cache.values(i, last),
                                                     scale=self.scale, enable_gqa=True)
                h = self.finish(i, h[:, -1:], out.transpose(1, 2).reshape(1, 1, -1))
            else:
                h = self.layer(cache, i, h, rows)
        return h

    def logits(self, h_last: torch.Tensor) -> torch.Tensor:
        """Hidden of one row [..., hidden] -> float32 logits [vocab] (only the last position is computed)."""
        return self.lm_head(self.norm(h_last.reshape(1, 1, -1)))[0, 0].float()
