"""Attention of query rows over the fused cache, each row causally by its global position: which kernel
runs which row set, so no path builds a dense [rows, keys] mask where the positions say it all.

Rows at sorted positions read keys [0, stop) with stop = last position + 1 (`Rows`). The paths:
- from zero (rows 0..stop-1, a full prefill): the kernel's own causal mask (`is_causal`);
- contiguous (the question; the check layer's all-rows pass of cacheblend and a3): the rows are the last
  R of the keys, row i sees keys 0..stop-R+i: causal attention aligned to the lower right, with no mask
  tensor (`torch.nn.attention.bias.causal_lower_right`: on CUDA the flash kernel, whose causal flag
  means exactly that alignment when rows and keys differ in number);
- scattered (a selective recompute): on CPU the blocked kernel (attention_cpu: keys before a block's
  first row unmasked, a short masked tail, merged by log-sum-exp); on CUDA FlexAttention, compiled, with
  a block mask from the positions (attention_flex);
- `dense`: one SDPA call with the [rows, keys] mask, the reference every path is tested against
  (tests/fusion/test_attention_paths.py), and the fallback where no other path applies.

A sliding-window layer (`window`: a row at position p sees keys > p - window, as transformers'
sliding-window mask) takes the same choice with its window: the blocked kernel masks each block at both
edges, FlexAttention's block mask skips the key blocks below every row's window, the dense mask spans
only the keys some row sees; the kernel's own causal flags have no lower edge, so the causal and
lower-right paths serve a windowed layer only while its rows' window hides nothing
(`effective_window`). Soft-capped logits (Gemma 2) are in no SDPA kernel: those models attend by the
written-out path (attention_math), or FlexAttention with a score_mod for scattered rows on CUDA.

`with_lse` serves the question-only probe (selection.py): the question's attention output and its
log-sum-exp over every key it sees, which normalises the probe's scores without a softmax over all keys
in fp32. docs/DESIGN.md (Fusion) says which path runs where.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kvfuse.fusion.model import attention_cpu, attention_flex, attention_math

log = logging.getLogger(__name__)
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)


def lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Rows q [1, H, R, D] at the last R of the keys k/v [1, Hkv, T, D] (row i sees keys 0..T-R+i)."""
    r, t = q.shape[2], k.shape[2]
    if r == t:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    # imported here: torch.nn.attention.bias loads torch's compiler (a second at import), which a process
    # that only lists the methods (the API's settings check) never needs
    from torch.nn.attention.bias import causal_lower_right

    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(r, t), scale=scale, enable_gqa=True)


def _flash_fits(q: torch.Tensor) -> bool:
    return (_FLASH is not None and q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256)


def with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, window: int | None = None,
             softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`lower_right`, and each row's log-sum-exp of its scaled scores over the keys it sees: (out
    [1, H, R, D] in q's dtype, lse [1, H, R] fp32). A sliding window that hides keys from the rows, or
    soft-capped logits, take the written-out path (attention_math)."""
    r, t = q.shape[2], k.shape[2]
    if softcap is not None or (window is not None and t > window):
        positions = torch.arange(t - r, t, device=q.device)
        return attention_math.attend(q, k, v, positions, scale, window=window, softcap=softcap, with_lse=True)
    if _flash_fits(q):  # causal = lower right in this op; GQA native; lse [1, H, R] fp32
        out, lse = _FLASH(q, k, v, 0.0, is_causal=True, return_debug_mask=False, scale=scale)[:2]
        return out, lse[:, :, :r].float()
    if attention_cpu.supports(q.device):  # keys before the rows unmasked (heads folded), the square causal
        h, hkv, d, a = q.shape[1], k.shape[1], q.shape[3], t - r
        o2, l2 = attention_cpu.lse_attention(q, k[:, :, a:], v[:, :, a:], is_causal=True, scale=scale)
        if a == 0:
            return o2.to(q.dtype), l2
        o1, l1 = attention_cpu.lse_attention(q.reshape(1, hkv, (h // hkv) * r, d), k[:, :, :a], v[:, :, :a],
                                             scale=scale)
        o1, l1 = o1.reshape(1, h, r, d), l1.reshape(1, h, r)
        lse = torch.logaddexp(l1, l2)
        return attention_cpu.merge(o1, l1, o2, l2).to(q.dtype), lse
    return _math_with_lse(q, k, v, scale)


def _math_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`with_lse` written out in fp32 (a device or dtype no LSE-returning kernel takes)."""
    h, hkv, r, t = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    kk = k.float().repeat_interleave(h // hkv, dim=1)
    vv = v.float().repeat_interleave(h // hkv, dim=1)
    scores = (q.float() @ kk.transpose(-1, -2)) * scale
    hidden = torch.ones(r, t, dtype=torch.bool, device=q.device).triu_(t - r + 1)
    scores.masked_fill_(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return (torch.exp(scores - lse[..., None]) @ vv).to(q.dtype), lse


def effective_window(rows, window: int | None) -> int | None:
    """The window if it hides any key from any of the rows (their last position reaches it), else None:
    rows that all see every key before them attend as on a global layer."""
    return window if window is not None and rows.stop > window else None


class Attention:
    """Rows (kvfuse.fusion.model.transformer.Rows) q [1, H, R, D] over k/v [1, Hkv, stop, D]: [1, H, R, D].

    block_rows: rows per block of the blocked CPU kernel (0: no blocked kernel);
    sparse: on CUDA, scattered rows through FlexAttention (False: the dense mask, the old path);
    softcap: attention logits capped at softcap * tanh(s / softcap) (Gemma 2; None: off)."""

    def __init__(self, scale: float, device: torch.device, block_rows: int = 0, sparse: bool = True,
                 softcap: float | None = None) -> None:
        self.scale = scale
        self.softcap = softcap
        self.blocked = (attention_cpu.BlockedAttention(block_rows, scale)
                        if block_rows > 0 and attention_cpu.supports(device) and softcap is None else None)
        self.flex = (attention_flex.FlexRows(scale, compiled=True, softcap=softcap)
                     if sparse and device.type == "cuda" and attention_flex.available() else None)

    def path(self, rows, window: int | None = None) -> str:
        """The path rows take on a layer with `window` (None: global): "causal", "lower_right", "blocked",
        "flex", "written" (attention_math: soft-capped logits) or "dense"."""
        w = effective_window(rows, window)
        scattered = rows.count != rows.stop and not rows.contiguous
        if self.softcap is not None:
            return "flex" if self.flex is not None and scattered else "written"
        if self.blocked is not None:
            return "blocked"
        if w is None and rows.count == rows.stop:
            return "causal"
        if w is None and rows.contiguous:
            return "lower_right"
        return "flex" if self.flex is not None else "dense"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows, window: int | None = None
                 ) -> torch.Tensor:
        w = effective_window(rows, window)
        path = self.path(rows, window)
        if path == "written":
            return attention_math.attend(q, k, v, rows.positions, self.scale, window=w, softcap=self.softcap)
        if path == "blocked":
            return self.blocked(q, k, v, rows, w)
        if path == "causal":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        if path == "lower_right":
            return lower_right(q, k, v, self.scale)
        if path == "flex":
            try:
                return self.flex(q, k, v, rows.planned(("flex", w), lambda: attention_flex.plan(rows.positions, w)))
            except Exception:  # noqa: BLE001 - no Triton, a compile error: the dense mask is always right
                log.exception("FlexAttention failed: scattered rows take the dense mask from now on")
                self.flex = None
                if self.softcap is not None:
                    return attention_math.attend(q, k, v, rows.positions, self.scale, window=w, softcap=self.softcap)
        lo, mask = rows.mask_for(w)
        return F.scaled_dot_product_attention(q, k[:, :, lo:], v[:, :, lo:], attn_mask=mask, scale=self.scale,
                                              enable_gqa=True)
