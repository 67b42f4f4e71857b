"""Attention written out, in row blocks, for what no fused kernel here computes: logit soft-capping.

Why: Gemma 2 caps every attention logit at `softcap * tanh(s / softcap)` before the softmax
(transformers' `eager_attention_forward`, the only attention Gemma 2 offers besides flash and flex);
PyTorch's SDPA kernels have no such step. So a model with soft-capping attends here on every path
where FlexAttention does not run (docs/DESIGN.md, Fusion): the scores of a block of rows over the keys
they read, capped, masked by position (causal, and a sliding window's lower edge), softmaxed in fp32,
times the values. Query heads that share a KV head are folded into the rows of one product, so each
key is read once per KV head. Blocks of `BLOCK_ROWS` rows bound the scores held at once to
BLOCK_ROWS x heads x keys.

It also serves as the reference the other paths are tested against with a window
(tests/fusion/test_attention_paths.py), and returns each row's log-sum-exp when asked (the probe).
"""

from __future__ import annotations

import torch

BLOCK_ROWS = 128


def key_range(first: int, last: int, window: int | None) -> tuple[int, int]:
    """Keys [lo, hi) any row at positions first..last reads (a window: keys > position - window)."""
    lo = 0 if window is None else max(0, first - window + 1)
    return lo, last + 1


def visible(positions: torch.Tensor, lo: int, hi: int, window: int | None) -> torch.Tensor:
    """bool [R, hi - lo]: row at `positions[i]` sees key lo + j (causal; within the window if any)."""
    keys = torch.arange(lo, hi, device=positions.device)[None, :]
    seen = keys <= positions[:, None]
    if window is not None:
        seen &= keys > positions[:, None] - window
    return seen


def additive(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where seen, -inf where not, in `dtype` (an SDPA mask the kernel does not convert)."""
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, float("-inf"))


def capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's soft-capping, in place where it can be: softcap * tanh(scores / softcap)."""
    if softcap is None:
        return scores
    return scores.div_(softcap).tanh_().mul_(softcap)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None, scale: float, *,
           window: int | None = None, softcap: float | None = None, with_lse: bool = False
           ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Rows q [1, H, R, D] at sorted `positions` [R] over keys k/v [1, Hkv, T, D] at positions 0..T-1:
    out [1, H, R, D] in q's dtype (and lse [1, H, R] fp32 with `with_lse`). positions None: every row
    sees every key (a decode step over the keys it reads)."""
    _, h, r, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    outs, lses = [], []
    for a in range(0, r, BLOCK_ROWS):
        b = min(a + BLOCK_ROWS, r)
        if positions is None:
            lo, hi, seen = 0, k.shape[2], None
        else:
            lo, hi = key_range(int(positions[a]), int(positions[b - 1]), window)
            seen = visible(positions[a:b], lo, hi, window)  # [rows, keys]
        qf = q[0, :, a:b].float().reshape(hkv, g * (b - a), d)
        scores = torch.bmm(qf, k[0, :, lo:hi].float().transpose(1, 2)).mul_(scale)  # [Hkv, g*rows, keys]
        scores = capped(scores, softcap).view(hkv, g, b - a, hi - lo)
        if seen is not None:
            scores.masked_fill_(~seen, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [Hkv, g, rows]
        probs = torch.exp(scores - lse[..., None]).view(hkv, g * (b - a), hi - lo)
        out = torch.bmm(probs, v[0, :, lo:hi].float()).view(h, b - a, d)
        outs.append(out)
        lses.append(lse.reshape(h, b - a))
    out = torch.cat(outs, dim=1).unsqueeze(0).to(q.dtype)
    return (out, torch.cat(lses, dim=1).unsqueeze(0)) if with_lse else out
