"""Scattered recomputed rows through FlexAttention with a block mask built from their positions.

Why: rows spread over the whole context (a selective recompute) see keys up to their own positions. A
dense [rows, keys] mask makes the kernel read the mask and compute the masked half
(docs/results/gpu/README.md). Here the rows go in blocks of `BLOCK` (the kernel's tile): every key block
that ends at or before a row block's first position is seen by all its rows (a full block, no mask
evaluated), the key blocks from there to its last row's position are partial (the mask `position[row]
>= key` evaluated in the kernel), and later key blocks are never read. A sliding-window layer's rows
see only keys > position - window: key blocks wholly inside every row's window are full, those that
reach past the first row's lower edge or the last row's position partial, earlier ones never read (a
plan per window size). Building it takes the sorted positions only: O(row blocks x key blocks)
integers, no [rows, keys] tensor. Soft-capped logits (Gemma 2) are a `score_mod`.

Shapes are rounded up into buckets so requests of similar size share one compiled kernel (compiled for
static sizes: dynamic sizes do not compile on every backend). Rows go to the next power of two, which
costs nothing: padded rows repeat the last row's position, and a row block made only of padding is
given no key blocks at all. Keys go to a multiple of BLOCK up to 1024, then to one of four steps per
octave (under 25 % padding: zeros no row reads, a copy of K/V per layer). A new (rows, keys) bucket
costs one compilation (docs/DESIGN.md, Fusion); the mask closure is matched by its code, not its
identity, so a new Rows of a known bucket does not recompile. Dynamo's per-function recompile limit is
raised for this call to `MAX_COMPILES`, the buckets a process can meet between 128 and 128k tokens.

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
MAX_COMPILES = 64  # recompile limit while calling the compiled kernel (one compile per shape bucket)


def available() -> bool:
    return flex_attention is not None


def bucket_rows(n: int) -> int:
    """n rounded up to a power of two, at least BLOCK (padding rows are free: see the module docstring)."""
    return max(BLOCK, 1 << (max(n, 1) - 1).bit_length())


def bucket_keys(n: int) -> int:
    """n rounded up: a multiple of BLOCK up to 1024, then one of four steps per octave."""
    if n <= 1024:
        return max(BLOCK, -(-n // BLOCK) * BLOCK)
    step = 1 << (math.floor(math.log2(n)) - 2)
    return -(-n // step) * step


@dataclass
class FlexPlan:
    """What every layer of one Rows shares: the padded positions and the block mask."""

    rows: int  # real rows; the first `rows` of the padded output are kept
    keys: int  # padded key length the kernel is given
    positions: torch.Tensor  # [padded rows]
    block_mask: object


def block_tables(positions: torch.Tensor, key_len: int, count: int, window: int | None = None
                 ) -> tuple[torch.Tensor, ...]:
    """(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) of rows at sorted `positions`
    (padded to a multiple of BLOCK; the first `count` are real) over `key_len` keys: per row block, its
    full key blocks (seen whole by every row: before its first row's position, and with a window, at or
    after its last row's lower edge) and its partial key blocks (any other block some row sees: up to
    the one holding its last row's position, from the one holding its first row's lower edge), each as
    counts [1, 1, Qb] and indices [1, 1, Qb, Kb] (listed first). A row block of padding only gets none."""
    device = positions.device
    qb, kb = positions.numel() // BLOCK, -(-key_len // BLOCK)
    first = positions[::BLOCK][:, None]  # [Qb, 1]
    last = positions[BLOCK - 1 :: BLOCK][:, None]
    start = torch.arange(kb, device=device)[None, :] * BLOCK  # each key block's first key
    real = (torch.arange(qb, device=device) * BLOCK < count)[:, None]
    is_full = (start + BLOCK <= first + 1) & real
    is_partial = (start <= last) & real
    if window is not None:
        is_full &= start >= last - window + 1
        is_partial &= start + BLOCK > first - window + 1
    is_partial &= ~is_full

    def table(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # indices of the chosen blocks first (a stable sort of "not chosen"), then anything
        order = torch.sort((~chosen).to(torch.int8), dim=1, stable=True).indices
        return chosen.sum(dim=1).to(torch.int32).view(1, 1, qb), order.to(torch.int32).view(1, 1, qb, kb)

    return (*table(is_partial), *table(is_full))


def plan(positions: torch.Tensor, window: int | None = None) -> FlexPlan:
    """The bucketed shapes and the block mask of rows at sorted `positions` (seeing keys > position -
    window on a sliding-window layer)."""
    count, stop = int(positions.numel()), int(positions[-1]) + 1
    rows, keys = bucket_rows(count), bucket_keys(stop)
    padded = torch.cat([positions, positions[-1:].expand(rows - count)]) if rows > count else positions

    if window is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return padded[q_idx] >= kv_idx
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return (padded[q_idx] >= kv_idx) & (padded[q_idx] - kv_idx < window)

    tables = block_tables(padded, keys, count, window)
    block_mask = BlockMask.from_kv_blocks(*tables, BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(rows, keys))
    return FlexPlan(count, keys, padded, block_mask)


def padded_kv(kv: torch.Tensor, keys: int) -> torch.Tensor:
    """K or V [1, Hkv, stop, D] with zeros appended up to `keys` entries. A copy, not the cache's own
    slots past `stop`: those may hold anything (they are written before a decode step reads them), and
    a partial key block reaching into them multiplies their values by zero weights, which keeps a NaN."""
    return F.pad(kv, (0, 0, 0, keys - kv.shape[2])) if keys > kv.shape[2] else kv


def softcap_mod(softcap: float):
    """Gemma 2's logit soft-capping as a FlexAttention score_mod."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return score_mod


class FlexRows:
    """Rows q [1, H, R, D] over a cache layer's K/V, by a FlexPlan: [1, H, R, D]. softcap: attention
    logits capped at softcap * tanh(s / softcap) (None: off)."""

    def __init__(self, scale: float, compiled: bool, softcap: float | None = None) -> None:
        self.scale = scale
        self.score_mod = softcap_mod(softcap) if softcap is not None else None
        self.kernel = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: FlexPlan) -> torch.Tensor:
        """k/v [1, Hkv, stop, D]: every key any row reads."""
        pad = p.positions.numel() - q.shape[2]
        if pad:
            q = torch.cat([q, q[:, :, -1:].expand(-1, -1, pad, -1)], dim=2)
        k, v = padded_kv(k, p.keys), padded_kv(v, p.keys)
        with torch._dynamo.config.patch(cache_size_limit=MAX_COMPILES):  # `recompile_limit` from torch 2.7
            out = self.kernel(q, k, v, score_mod=self.score_mod, block_mask=p.block_mask, scale=self.scale,
                              enable_gqa=True)
        return out[:, :, : p.rows]
