"""A layer loop over the model's own modules that can run any subset of query rows.

The HF attention module appends to its cache and cannot overwrite rows in the middle, so selective
recomputation runs the decoder layers here: norms, projections, MLP and the rotary module are the
model's; attention is `scaled_dot_product_attention` over the fused cache (GQA via `enable_gqa`).

`Rows` holds what every layer shares for one set of query rows: positions, cos/sin and the attention
blocks with their masks, built once per phase and never per layer. Rows are sorted by position and go
in blocks; a block's keys are covered by two kernel calls merged by their log-sum-exp: one unmasked
call over the keys every row of the block sees (all keys before its first row), and one masked call
over the short tail up to its last row. A single masked call over all the keys costs ~18 % more on CPU
(the kernel reads and adds the mask for every head and key). Query heads that share a KV head are
folded into the rows of a call: each key is read once per KV head, and the kernel tiles taller query
blocks (it uses 32-row tiles below 192 rows). Devices without the CPU kernel that returns the
log-sum-exp take one masked call per block.

A fused cache may carry a key bias (`FusedCache.key_bias`, additive on the attention logits, 0 for
exact keys). Only rows at or after `Rows.biased_from` apply it (the question and generated tokens); their
blocks take one masked call with the bias folded into the mask. They are tens of rows, so the mask is small.
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


# The CPU flash-attention kernel behind F.scaled_dot_product_attention, which also returns the
# log-sum-exp of each row's scores: what merging two partial softmaxes needs. Private to torch (present
# since 2.2, GQA-aware); without it every block takes one masked call.
_LSE_ATTENTION = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass
class Block:
    """Query rows [start, stop) of a Rows; they read keys [0, key_len): [0, visible) are seen by every
    row of the block, the tail [visible, key_len) is causal (the rows are exactly those positions) or
    masked by `tail_mask`."""

    start: int
    stop: int
    visible: int
    key_len: int
    tail_mask: torch.Tensor | None  # additive [rows, key_len - visible] (0 or -inf); None: causal tail
    no_tail: torch.Tensor | None  # bool [rows]: rows that see none of the tail (their partial is empty)
    biased: bool = False  # the rows apply the cache's key bias
    _full_mask: torch.Tensor | None = None
    _biased_mask: torch.Tensor | None = None
    _folded: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def folded(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tail_mask, no_tail) repeated for `group` query heads folded into the rows (built once)."""
        if self._folded is None or self._folded[0] != group:
            self._folded = (group, self.tail_mask.repeat(group, 1), self.no_tail.repeat(group))
        return self._folded[1], self._folded[2]

    def full_mask(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Additive [rows, key_len] mask for one call over all the block's keys (built once)."""
        if self._full_mask is None:
            rows = self.stop - self.start
            tail = self.tail_mask
            if tail is None:  # causal tail over exactly these rows
                tail = torch.full((rows, rows), float("-inf"), dtype=dtype, device=device).triu_(1)
            head = torch.zeros(rows, self.visible, dtype=dtype, device=device)
            self._full_mask = torch.cat([head, tail.to(device=device, dtype=dtype)], dim=1)
        return self._full_mask

    def biased_mask(self, key_bias: torch.Tensor) -> torch.Tensor:
        """The block's full mask plus the key bias [key_len] (built once: a Rows serves one cache)."""
        if self._biased_mask is None:
            self._biased_mask = self.full_mask(key_bias.dtype, key_bias.device) + key_bias
        return self._biased_mask


def _merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
    """Attention over two key sets from each set's output [..., R, D] and log-sum-exp [..., R]."""
    lse = torch.logaddexp(l1, l2)
    return o1 * torch.exp(l1 - lse).unsqueeze(-1) + o2 * torch.exp(l2 - lse).unsqueeze(-1)


class Rows:
    """Query rows at sorted global positions, with per-phase state shared by every layer.

    biased_from: rows at this position or later apply the cache's key bias (None: no row does)."""

    def __init__(self, positions: torch.Tensor, rope: Rope, dtype: torch.dtype, block_rows: int,
                 biased_from: int | None = None) -> None:
        self.positions = positions
        self.count = int(positions.numel())
        self.cos, self.sin = (t.unsqueeze(1) for t in rope.cos_sin(positions, dtype))  # [1, 1, R, D]
        first, last = int(positions[0]), int(positions[-1])
        self.contiguous = last - first + 1 == self.count
        self.start = first
        self.stop = last + 1  # keys [0, stop) are all any row reads
        # index of the first biased row; rows are sorted, so the biased ones are a suffix
        self.first_biased = self.count if biased_from is None else int((positions < biased_from).sum())
        self.blocks = self._blocks(block_rows, dtype)

    @property
    def last_biased(self) -> bool:
        """Whether the last row applies the key bias (then so does every row from `first_biased`)."""
        return self.first_biased < self.count

    def _blocks(self, block_rows: int, dtype: torch.dtype) -> list[Block]:
        if self.count == 1:  # one row (a decode step): it sees every key up to its position
            return [Block(0, 1, self.stop, self.stop, None, None, biased=self.last_biased)]
        if self.contiguous and not self.last_biased:  # keys before the rows, then the rows' own causal square
            return [Block(0, self.count, self.start, self.stop, None, None)]
        # biased rows go in blocks of their own
        return (self._range_blocks(0, self.first_biased, block_rows, dtype, False)
                + self._range_blocks(self.first_biased, self.count, block_rows, dtype, True))

    def _range_blocks(self, lo: int, hi: int, block_rows: int, dtype: torch.dtype, biased: bool) -> list[Block]:
        pos = self.positions
        blocks = []
        for a in range(lo, hi, block_rows):
            b = min(a + block_rows, hi)
            visible, key_len = int(pos[a]) + 1, int(pos[b - 1]) + 1
            tail_mask = no_tail = None
            if key_len > visible:
                hidden = pos[a:b, None] < torch.arange(visible, key_len, device=pos.device)[None, :]
                # additive, in the compute dtype: the kernel would convert a bool mask on every call
                tail_mask = torch.zeros(hidden.shape, dtype=dtype, device=pos.device).masked_fill_(hidden, float("-inf"))
                no_tail = hidden.all(dim=1)
            blocks.append(Block(a, b, visible, key_len, tail_mask, no_tail, biased=biased))
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
        k, v = cache.keys(layer, rows.stop), cache.values(layer, rows.stop)
        outs = [self._attend_block(k, v, b, q[:, :, b.start : b.stop], cache.key_bias) for b in rows.blocks]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return out.transpose(1, 2).reshape(1, rows.count, self.num_heads * self.head_dim)

    def _attend_block(self, k: torch.Tensor, v: torch.Tensor, b: Block, q: torch.Tensor,
                      key_bias: torch.Tensor | None) -> torch.Tensor:
        k, v = k[:, :, : b.key_len], v[:, :, : b.key_len]
        bias = key_bias[: b.key_len] if b.biased and key_bias is not None else None
        if b.key_len == b.visible:  # every row sees every key (a decode step)
            return self.attend_all(q, k, v, bias)
        if bias is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=b.biased_mask(bias), scale=self.scale,
                                                  enable_gqa=True)
        if b.visible == 0 and b.tail_mask is None:  # rows 0..n-1: the kernel's own causal mask
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        if _LSE_ATTENTION is None or q.device.type != "cpu" or b.visible == 0:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=b.full_mask(q.dtype, q.device), scale=self.scale,
                                                  enable_gqa=True)
        vis = b.visible
        if b.tail_mask is None:  # causal tail: row i of the square sees tail keys 0..i (heads unfolded)
            o1, l1 = _LSE_ATTENTION(q, k[:, :, :vis], v[:, :, :vis], scale=self.scale)
            o2, l2 = _LSE_ATTENTION(q, k[:, :, vis:], v[:, :, vis:], is_causal=True, scale=self.scale)
            return _merge(o1, l1, o2, l2).to(q.dtype)
        h, hkv, r, d = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
        qf = q.reshape(1, hkv, (h // hkv) * r, d)
        tail_mask, no_tail = b.folded(h // hkv)
        o1, l1 = _LSE_ATTENTION(qf, k[:, :, :vis], v[:, :, :vis], scale=self.scale)
        o2, l2 = _LSE_ATTENTION(qf, k[:, :, vis:], v[:, :, vis:], attn_mask=tail_mask, scale=self.scale)
        l2 = l2.masked_fill(no_tail, float("-inf"))  # the kernel reports an all-masked row as lse 0, output 0
        return _merge(o1, l1, o2, l2).to(q.dtype).view(1, h, r, d)

    def attend_all(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   key_bias: torch.Tensor | None = None) -> torch.Tensor:
        """Rows q [1, H, R, D] that all see every key of k/v [1, Hkv, T, D]: [1, H, R, D].

        The query heads sharing a KV head are folded into the rows of one call, so each key is read
        once per KV head instead of once per query head (a decode step is bound by reading the cache:
        this takes ~30 % off its attention time with 3 query heads per KV head). key_bias: additive
        [T] on every row's logits (None: none)."""
        _, h, r, d = q.shape
        hkv = k.shape[1]
        mask = None if key_bias is None else key_bias.view(1, -1)
        if h == hkv:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        out = F.scaled_dot_product_attention(q.reshape(1, hkv, (h // hkv) * r, d), k, v, attn_mask=mask,
                                             scale=self.scale)
        return out.view(1, h, r, d)

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
                bias = cache.key_bias[:last] if rows.last_biased and cache.key_bias is not None else None
                out = self.attend_all(q[:, :, -1:], cache.keys(i, last), cache.values(i, last), bias)
                h = self.finish(i, h[:, -1:], out.transpose(1, 2).reshape(1, 1, -1))
            else:
                h = self.layer(cache, i, h, rows)
        return h

    def logits(self, h_last: torch.Tensor) -> torch.Tensor:
        """Hidden of one row [..., hidden] -> float32 logits [vocab] (only the last position is computed)."""
        return self.lm_head(self.norm(h_last.reshape(1, 1, -1)))[0, 0].float()
