"""Attention over the fused cache on the default model's shape against attention written out by hand:
the paths without the blocked kernel (the dense mask, causal, lower-right causal) and the blocked CPU
kernel (`attention_cpu`), which must give the same result. Every path on random shapes, FlexAttention
included: tests/fusion/test_attention_paths.py."""

from __future__ import annotations

import pytest
import torch

from kvfuse.fusion.engine.fused_cache import FusedCache
from kvfuse.fusion.model import attention_cpu
from kvfuse.fusion.model.attention import Attention
from kvfuse.fusion.model.transformer import Rows, Transformer

TOTAL = 300


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Row i sees keys 0..positions[i]; q [1, H, R, D], k/v [1, Hkv, T, D] -> [1, H, R, D]."""
    h, hkv = q.shape[1], k.shape[1]
    kk, vv = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
    scores = (q @ kk.transpose(-1, -2)) * scale
    hidden = torch.arange(k.shape[2])[None, :] > positions[:, None]
    return scores.masked_fill(hidden, float("-inf")).softmax(-1) @ vv


def _positions(kind: str, gen: torch.Generator) -> torch.Tensor:
    return {
        "scattered": torch.sort(torch.randperm(TOTAL, generator=gen)[:70]).values,
        "contiguous-after-prefix": torch.arange(40, TOTAL),
        "from-zero": torch.arange(TOTAL),
        "one-row": torch.tensor([TOTAL - 1]),
        "starts-at-zero": torch.cat([torch.tensor([0, 5]), torch.arange(200, 230)]),
        "scattered-then-question": torch.cat([torch.sort(torch.randperm(260, generator=gen)[:50]).values,
                                              torch.arange(260, TOTAL)]),
    }[kind]


KINDS = ["scattered", "contiguous-after-prefix", "from-zero", "one-row", "starts-at-zero", "scattered-then-question"]


@pytest.mark.parametrize("path", ["dense", "blocked"])
@pytest.mark.parametrize("kind", KINDS)
def test_attention_matches_attention_by_hand(engine, path: str, kind: str) -> None:
    tf: Transformer = engine.tf
    gen = torch.Generator().manual_seed(3)
    positions = _positions(kind, gen)
    cache = FusedCache(tf.num_layers, tf.num_kv_heads, tf.head_dim, TOTAL + 8, torch.float32, torch.device("cpu"))
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=gen))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=gen))
    cache.length = TOTAL
    q = torch.randn(1, tf.num_heads, positions.numel(), tf.head_dim, generator=gen)
    rows = Rows(positions, engine.rope, torch.float32)
    k, v = cache.keys(0, rows.stop), cache.values(0, rows.stop)
    if path == "dense":  # the transformer's paths without the blocked kernel
        out = Attention(tf.scale, torch.device("cpu"))(q, k, v, rows)
    else:
        out = attention_cpu.BlockedAttention(16, tf.scale)(q, k, v, rows)
        if kind == "scattered":  # 70 rows in blocks of 16
            assert [b.stop - b.start for b in rows._plans[("blocked", None)]] == [16, 16, 16, 16, 6]
    torch.testing.assert_close(out, _reference(q, k, v, positions, tf.scale), atol=1e-5, rtol=1e-5)
