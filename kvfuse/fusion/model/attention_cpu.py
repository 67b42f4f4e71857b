"""Blocked attention for the CPU: the same result as the transformer's dense call, with less work.

Why: the dense path is one masked `scaled_dot_product_attention` call over every key up to the last
row, and the CPU kernel reads and adds the mask for every head and key, masked or not. Here the rows
go in blocks of `block_rows`, and a block's keys are covered by two kernel calls merged by their
log-sum-exp: an unmasked call over the keys every row of the block sees (all keys before its first
row) and a masked call over the short tail up to its last row. Query heads that share a KV head are
folded into the rows of a call, so each key is read once per KV head and the kernel tiles taller
query blocks. The speed-up and how it was measured: docs/DESIGN.md (Fusion).

A sliding-window layer's row sees only keys > position - window: a block then reads keys from its first
row's lower edge to its last row's position, in one call masked at both edges (window + block keys at
most, whatever the context).

The kernel that also returns the log-sum-exp is private to torch (present since 2.2, GQA-aware);
without it, or off the CPU, the transformer keeps the dense path. tests/fusion/test_attention_blocks.py
pins this module to the dense path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvfuse.fusion.model import attention_math

lse_attention = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def causal_mask(positions: torch.Tensor, key_start: int, key_stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [R, key_stop - key_start] of rows at `positions` over keys [key_start, key_stop):
    0 where a row sees the key (key <= its position), -inf where not."""
    keys = torch.arange(key_start, key_stop, device=positions.device)
    hidden = positions[:, None] < keys[None, :]
    return torch.zeros(hidden.shape, dtype=dtype, device=positions.device).masked_fill_(hidden, -torch.inf)


def supports(device: torch.device) -> bool:
    """Whether the blocked kernel can run on `device`."""
    return device.type == "cpu" and lse_attention is not None


@dataclass
class Block:
    """Query rows [start, stop) of a Rows; they read keys [key_lo, key_len): [key_lo, visible) are seen by
    every row of the block, the tail [visible, key_len) is causal (the rows are exactly those positions)
    or masked by `tail_mask`. A windowed block (key_lo may be > 0) has visible == key_lo: its whole key
    range is masked by `tail_mask`."""

    start: int
    stop: int
    visible: int
    key_len: int
    tail_mask: torch.Tensor | None  # additive [rows * group, key_len - visible], heads folded; None: causal
    no_tail: torch.Tensor | None  # bool [rows * group]: rows that see none of the tail (their partial is empty)
    key_lo: int = 0
    windowed: bool = False


def windowed_plan(positions: torch.Tensor, block_rows: int, group: int, dtype: torch.dtype, window: int
                  ) -> list[Block]:
    """The blocks of rows at sorted `positions` on a sliding-window layer: each reads keys from its first
    row's lower edge to its last row's position, masked at both edges (heads folded into the mask)."""
    blocks = []
    for a in range(0, int(positions.numel()), block_rows):
        b = min(a + block_rows, int(positions.numel()))
        lo, hi = attention_math.key_range(int(positions[a]), int(positions[b - 1]), window)
        mask = attention_math.additive(attention_math.visible(positions[a:b], lo, hi, window), dtype)
        blocks.append(Block(a, b, lo, hi, mask.repeat(group, 1), None, key_lo=lo, windowed=True))
    return blocks


def plan(positions: torch.Tensor, block_rows: int, group: int, dtype: torch.dtype, window: int | None = None
         ) -> list[Block]:
    """The blocks of rows at sorted `positions`, with `group` query heads per KV head folded into each
    tail mask (additive, in `dtype`; built from the positions, never from a dense [rows, keys] mask).
    window: a sliding-window layer's (`windowed_plan`); None: every key up to the row's position."""
    if window is not None:
        return windowed_plan(positions, block_rows, group, dtype, window)
    count, first, last = int(positions.numel()), int(positions[0]), int(positions[-1])
    if count == 1:  # one row (a decode step): it sees every key up to its position
        return [Block(0, 1, last + 1, last + 1, None, None)]
    if last - first + 1 == count:  # contiguous: keys before the rows, then their causal square
        return [Block(0, count, first, last + 1, None, None)]
    blocks = []
    for a in range(0, count, block_rows):
        b = min(a + block_rows, count)
        visible, key_len = int(positions[a]) + 1, int(positions[b - 1]) + 1
        tail_mask = no_tail = None
        if key_len > visible:
            tail = causal_mask(positions[a:b], visible, key_len, dtype)
            tail_mask, no_tail = tail.repeat(group, 1), torch.isinf(tail).all(dim=1).repeat(group)
        blocks.append(Block(a, b, visible, key_len, tail_mask, no_tail))
    return blocks


def merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
    """Attention over two key sets from each set's output [..., R, D] and log-sum-exp [..., R]."""
    lse = torch.logaddexp(l1, l2)
    return o1 * torch.exp(l1 - lse).unsqueeze(-1) + o2 * torch.exp(l2 - lse).unsqueeze(-1)


class BlockedAttention:
    """Rows q [1, H, R, D] attending causally by position over k/v [1, Hkv, stop, D]: [1, H, R, D]."""

    def __init__(self, block_rows: int, scale: float) -> None:
        self.block_rows = block_rows
        self.scale = scale

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows, window: int | None = None
                 ) -> torch.Tensor:
        """rows: kvfuse.fusion.model.transformer.Rows (its blocks are planned once per window size, on the
        first layer that needs them); window: the layer's sliding window (None: a global layer)."""
        blocks = rows.planned(("blocked", window), lambda: plan(rows.positions, self.block_rows,
                                                                q.shape[1] // k.shape[1], q.dtype, window))
        outs = [self._block(q[:, :, b.start : b.stop], k[:, :, b.key_lo : b.key_len], v[:, :, b.key_lo : b.key_len],
                            b, rows) for b in blocks]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def _block(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: Block, rows) -> torch.Tensor:
        h, hkv, r, d = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
        vis, scale = b.visible, self.scale
        if b.windowed:  # both edges masked, heads folded (every row sees at least its own key)
            out = F.scaled_dot_product_attention(q.reshape(1, hkv, (h // hkv) * r, d), k, v, attn_mask=b.tail_mask,
                                                 scale=scale)
            return out.view(1, h, r, d)
        if b.key_len == vis:  # every row sees every key: heads folded, no mask
            out = F.scaled_dot_product_attention(q.reshape(1, hkv, (h // hkv) * r, d), k, v, scale=scale)
            return out.view(1, h, r, d)
        if vis == 0 and b.tail_mask is None:  # rows 0..n-1: the kernel's own causal mask
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        if vis == 0:  # nothing every row sees: the dense call on the block's own mask
            mask = causal_mask(rows.positions[b.start : b.stop], 0, b.key_len, q.dtype)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        if b.tail_mask is None:  # causal tail: row i of the square sees tail keys 0..i (heads unfolded)
            o1, l1 = lse_attention(q, k[:, :, :vis], v[:, :, :vis], scale=scale)
            o2, l2 = lse_attention(q, k[:, :, vis:], v[:, :, vis:], is_causal=True, scale=scale)
            return merge(o1, l1, o2, l2).to(q.dtype)
        qf = q.reshape(1, hkv, (h // hkv) * r, d)
        o1, l1 = lse_attention(qf, k[:, :, :vis], v[:, :, :vis], scale=scale)
        o2, l2 = lse_attention(qf, k[:, :, vis:], v[:, :, vis:], attn_mask=b.tail_mask, scale=scale)
        l2 = l2.masked_fill(b.no_tail, float("-inf"))  # the kernel reports an all-masked row as lse 0, output 0
        return merge(o1, l1, o2, l2).to(q.dtype).view(1, h, r, d)
