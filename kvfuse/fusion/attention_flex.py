"""Scattered recomputed rows through FlexAttention with a block mask built from their positions.

Why: rows spread over the whole context (a selective recompute) see keys up to their own positions. A
dense [rows, keys] mask makes the kernel read the mask and compute the masked half
(docs/results/gpu/README.md). Here the rows go in blocks of `BLOCK` (the kernel's tile): every key block
that ends at or before a row block's first position is seen by all its rows (a full block, no mask
evaluated), the key blocks from there to its last row's position are partial (the mask `position[row]
>= key` evaluated in the kernel), and later key blocks are never read. Building it takes the sorted
positions only: O(row blocks x key blocks) integers, no [rows, keys] tensor.

Shapes are rounded up into buckets (`bucket`: multiples of BLOCK up to 1024, then eight steps per
octave) so requests of similar size share one compiled kernel: padded rows repeat the last row's
position (their outputs are dropped), padded keys are zeros after every position (never read). The
compile uses torch.compile's automatic dynamic shapes: the first bucket compiles for its sizes, a second
one compiles once more with symbolic sizes, which then serves every later bucket (the cost of a new
shape: docs/DESIGN.md, Fusion). The mask closure is matched by its code, not its identity, so a new
Rows does not recompile.

On CUDA the kernel is compiled (`torch.compile(flex_attention)`); elsewhere the same call runs eagerly,
which materialises the scores: the CPU tests run this module's plan and padding that way
(tests/fusion/test_attention_paths.py). The CPU's own fast path is attention_cpu.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:  # FlexAttention: torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - the pinned torch has it
    BlockMask = flex_attention = None

BLOCK = 128  # rows and keys per tile (FlexAttention's default block size)


def available() -> bool:
    return flex_attention is not None


def bucket(n: int) -> int:
    """n rounded up: a multiple of BLOCK up to 1024, then to one of eight steps per octave (at most
    12.5 % padding), so nearby sizes share one compiled kernel."""
    if n <= 1024:
        return max(BLOCK, -(-n // BLOCK) * BLOCK)
    step = 1 << (math.floor(math.log2(n)) - 3)
    return -(-n // step) * step


@dataclass
class FlexPlan:
    """What every layer of one Rows shares: the padded positions and the block mask."""

    rows: int  # real rows; the first `rows` of the padded output are kept
    keys: int  # padded key length the kernel is given
    positions: torch.Tensor  # [padded rows]
    block_mask: object


def block_tables(positions: torch.Tensor, key_len: int) -> tuple[torch.Tensor, ...]:
    """(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) of rows at sorted `positions`
    (padded to a multiple of BLOCK) over `key_len` keys: per row block, its partial key blocks (from the
    one holding its first row's position to the one holding its last's) and its full key blocks (every
    key block before that), each as counts [1, 1, Qb] and indices [1, 1, Qb, Kb] (listed first)."""
    device = positions.device
    qb, kb = positions.numel() // BLOCK, -(-key_len // BLOCK)
    first = positions[::BLOCK]  # [Qb]
    last = positions[BLOCK - 1 :: BLOCK]
    full = torch.div(first + 1, BLOCK, rounding_mode="floor")  # key blocks [0, full) wholly seen
    stop = torch.div(last, BLOCK, rounding_mode="floor") + 1  # key blocks [full, stop) partly seen
    j = torch.arange(kb, device=device)
    is_full = j[None, :] < full[:, None]
    is_partial = (j[None, :] >= full[:, None]) & (j[None, :] < stop[:, None])

    def table(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # indices of the chosen blocks first (a stable sort of "not chosen"), then anything
        order = torch.sort((~chosen).to(torch.int8), dim=1, stable=True).indices
        return chosen.sum(dim=1).to(torch.int32).view(1, 1, qb), order.to(torch.int32).view(1, 1, qb, kb)

    return (*table(is_partial), *table(is_full))


def plan(positions: torch.Tensor) -> FlexPlan:
    """The bucketed shapes and the block mask of rows at sorted `positions`."""
    count, stop = int(positions.numel()), int(positions[-1]) + 1
    rows, keys = bucket(count), bucket(stop)
    padded = torch.cat([positions, positions[-1:].expand(rows - count)]) if rows > count else positions

    def mask_mod(b, h, q_idx, kv_idx):
        return padded[q_idx] >= kv_idx

    tables = block_tables(padded, keys)
    block_mask = BlockMask.from_kv_blocks(*tables, BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(rows, keys))
    return FlexPlan(count, keys, padded, block_mask)


def padded_kv(kv: torch.Tensor, keys: int) -> torch.Tensor:
    """K or V [1, Hkv, stop, D] with zeros appended up to `keys` entries. A copy, not the cache's own
    slots past `stop`: those may hold anything (they are written before a decode step reads them), and
    a partial key block reaching into them multiplies their values by zero weights, which keeps a NaN."""
    return F.pad(kv, (0, 0, 0, keys - kv.shape[2])) if keys > kv.shape[2] else kv


class FlexRows:
    """Rows q [1, H, R, D] over a cache layer's K/V, by a FlexPlan: [1, H, R, D]."""

    def __init__(self, scale: float, compiled: bool) -> None:
        self.scale = scale
        self.kernel = torch.compile(flex_attention) if compiled else flex_attention

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: FlexPlan) -> torch.Tensor:
        """k/v [1, Hkv, stop, D]: every key any row reads."""
        pad = p.positions.numel() - q.shape[2]
        if pad:
            q = torch.cat([q, q[:, :, -1:].expand(-1, -1, pad, -1)], dim=2)
        k, v = padded_kv(k, p.keys), padded_kv(v, p.keys)
        out = self.kernel(q, k, v, block_mask=p.block_mask, scale=self.scale, enable_gqa=True)
        return out[:, :, : p.rows]
