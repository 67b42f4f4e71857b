"""Scoring primitives that token selectors are built from. Pure tensor functions, no model state.

Attention probes compute Q·K^T for the question rows only, in fp32: [H, Rq, T] is small (Rq is tens of
tokens) where a full attention matrix would be T x T.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvfuse.fusion.model import attention_math


def budget(ratio: float, n: int) -> int:
    """Selection size round(ratio * n), rounding halves up, within [0, n]."""
    return max(0, min(n, int(math.floor(ratio * n + 0.5))))


def attention_probs(q: torch.Tensor, q_positions: torch.Tensor, keys: torch.Tensor, scale: float, *,
                    window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Softmax attention of query rows over keys at positions 0..T-1, causal by position; fp32.

    q: [1, H, R, D]; keys: [1, Hkv, T, D] with query head h reading kv head h // (H / Hkv).
    window: a sliding-window layer's (a row at p sees keys > p - window); softcap: logits capped as the
    model caps them (attention_math.capped). Returns [H, R, T] probabilities (each row sums to 1 over
    the keys it may see).
    """
    _, h, r, d = q.shape
    hkv, t = keys.shape[1], keys.shape[2]
    qf = q[0].float().reshape(hkv, (h // hkv) * r, d)
    scores = torch.matmul(qf, keys[0].float().transpose(1, 2)).mul_(scale)  # [Hkv, g*R, T]
    scores = attention_math.capped(scores, softcap).view(h, r, t)
    lo = int(q_positions.min()) + 1  # keys before it are seen by every row: only the tail is masked
    if lo < t:
        hidden = torch.arange(lo, t, device=q.device)[None, :] > q_positions[:, None]  # [R, T - lo]
        scores[:, :, lo:].masked_fill_(hidden[None], float("-inf"))
    if window is not None:
        seen = attention_math.visible(q_positions, 0, t, window)
        scores.masked_fill_(~seen[None], float("-inf"))
    return torch.softmax(scores, dim=-1)


def probs_from_lse(q: torch.Tensor, keys: torch.Tensor, lse: torch.Tensor, scale: float, *,
                   softcap: float | None = None, window: int | None = None,
                   q_positions: torch.Tensor | None = None, key_start: int = 0) -> torch.Tensor:
    """Softmax probabilities of query rows onto keys before them, given each row's log-sum-exp over
    all the keys it sees (an attention kernel's, kvfuse.fusion.model.attention.with_lse): exp(q.k * scale -
    lse). q [1, H, R, D], keys [1, Hkv, N, D] (a view: no copy), lse [1, H, R] fp32 -> [H, R, N] fp32.
    softcap: the logits capped as the model caps them; window (with the rows' `q_positions` and the
    keys' first position `key_start`): keys outside a row's window get 0.

    Only the N scored columns are computed; the product is taken in the inputs' dtype with fp32 output
    (`_scores`), so 16-bit K is never widened to an fp32 copy."""
    _, h, r, d = q.shape
    hkv, n = keys.shape[1], keys.shape[2]
    scores = _scores(q[0].reshape(hkv, (h // hkv) * r, d), keys[0].transpose(1, 2))  # [Hkv, g*R, N]
    scores = attention_math.capped(scores.mul_(scale), softcap).view(h, r, n)
    probs = torch.exp(scores.sub_(lse[0, :, :, None]))
    if window is not None and q_positions is not None:
        seen = attention_math.visible(q_positions, key_start, key_start + n, window)
        probs.masked_fill_(~seen[None], 0.0)
    return probs


_OUT_DTYPE_BMM = [True]  # whether this torch build has bmm with an fp32 output for 16-bit inputs here


def _scores(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b as fp32: fp32 inputs as they are; 16-bit inputs on CUDA through bmm's fp32 output (fp32
    accumulation, no widened copy); elsewhere widened first."""
    if a.dtype == torch.float32:
        return torch.bmm(a, b)
    if a.device.type == "cuda" and _OUT_DTYPE_BMM[0]:
        try:
            return torch.bmm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            _OUT_DTYPE_BMM[0] = False
    return torch.bmm(a.float(), b.float())


def apply_probs(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[H, R, T] probabilities x values [1, Hkv, T, D] -> attention output [1, H, R, D] in fp32."""
    h, r, t = probs.shape
    hkv = values.shape[1]
    out = torch.matmul(probs.view(hkv, (h // hkv) * r, t), values[0].float())  # [Hkv, g*R, D]
    return out.view(1, h, r, -1)


def value_deviation(v_new: torch.Tensor, v_cached: torch.Tensor) -> torch.Tensor:
    """Per-token ||V_new - V_cached|| over heads and head dims: [1, Hkv, N, D] x 2 -> [N] fp32."""
    diff = v_new[0].float() - v_cached[0].float()
    return diff.pow(2).sum(dim=(0, 2)).sqrt()


def smooth(scores: torch.Tensor, window: int) -> torch.Tensor:
    """Width-`window` average pooling along the tokens (stride 1, same length; zero padding counted)."""
    if window <= 1:
        return scores
    pad = window // 2
    out = F.avg_pool1d(scores.view(1, 1, -1), kernel_size=window, stride=1, padding=pad)
    return out.view(-1)[: scores.numel()]


def top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k highest scores, sorted ascending (ties broken by the sort, deterministic)."""
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=scores.device)
    if k >= scores.numel():
        return torch.arange(scores.numel(), device=scores.device)
    return torch.sort(torch.topk(scores, k, sorted=False).indices).values


def chunk_edges(chunk_lens: list[int], first: int, last: int, device: torch.device | str = "cpu", *,
                only: Sequence[bool] | None = None) -> torch.Tensor:
    """Context-relative indices of the first `first` and last `last` tokens of each chunk, sorted;
    `only` (one flag per chunk) restricts them to the flagged chunks."""
    mask = torch.zeros(sum(chunk_lens), dtype=torch.bool, device=device)
    start = 0
    for i, n in enumerate(chunk_lens):
        if only is None or only[i]:
            mask[start : start + min(first, n)] = True
            if last > 0:
                mask[start + max(0, n - last) : start + n] = True
        start += n
    return mask.nonzero().view(-1)
