"""The blocked attention of `Transformer.attend` against dense causal attention by global position."""

from __future__ import annotations

import pytest
import torch

from kvfuse.fusion import transformer
from kvfuse.fusion.cache import FusedCache
from kvfuse.fusion.transformer import Rows, Transformer


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float,
               bias: torch.Tensor | None = None, biased_from: int = 0) -> torch.Tensor:
    """Dense attention: row i sees keys 0..positions[i]; q [1, H, R, D], k/v [1, Hkv, T, D] -> [1, R, H*D].
    bias: additive [T] on the logits of the rows at positions >= biased_from."""
    h, hkv = q.shape[1], k.shape[1]
    kk, vv = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
    scores = (q @ kk.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + (positions >= biased_from).float()[:, None] * bias[None, :]
    hidden = torch.arange(k.shape[2])[None, :] > positions[:, None]
    probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    return (probs @ vv).transpose(1, 2).reshape(1, q.shape[2], -1)


@pytest.mark.parametrize("lse_kernel", [True, False], ids=["split", "one-masked-call"])
@pytest.mark.parametrize("kind", ["scattered", "contiguous-after-prefix", "from-zero", "one-row", "starts-at-zero"])
def test_blocked_attention_matches_dense(engine, monkeypatch, lse_kernel: bool, kind: str) -> None:
    if not lse_kernel:
        monkeypatch.setattr(transformer, "_LSE_ATTENTION", None)
    tf: Transformer = engine.tf
    total = 300
    gen = torch.Generator().manual_seed(3)
    positions = {
        "scattered": torch.sort(torch.randperm(total, generator=gen)[:70]).values,
        "contiguous-after-prefix": torch.arange(40, total),
        "from-zero": torch.arange(total),
        "one-row": torch.tensor([total - 1]),
        "starts-at-zero": torch.cat([torch.tensor([0, 5]), torch.arange(200, 230)]),
    }[kind]
    cache = FusedCache(tf.num_layers, tf.num_kv_heads, tf.head_dim, total + 8, torch.float32, torch.device("cpu"))
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=gen))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=gen))
    cache.length = total
    rows = Rows(positions, engine.rope, torch.float32, block_rows=16)
    q = torch.randn(1, tf.num_heads, positions.numel(), tf.head_dim, generator=gen)
    out = tf.attend(cache, 0, rows, q)
    ref = _reference(q, cache.keys(0, total), cache.values(0, total), positions, tf.scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lse_kernel", [True, False], ids=["split", "one-masked-call"])
@pytest.mark.parametrize("kind", ["scattered-then-question", "question-only", "decode-row"])
def test_key_bias_applies_to_rows_from_biased_from(engine, monkeypatch, lse_kernel: bool, kind: str) -> None:
    """Rows at or after `biased_from` add the cache's key bias to their logits; earlier rows do not."""
    if not lse_kernel:
        monkeypatch.setattr(transformer, "_LSE_ATTENTION", None)
    tf: Transformer = engine.tf
    total, question_start = 300, 260
    gen = torch.Generator().manual_seed(5)
    positions = {
        "scattered-then-question": torch.cat([torch.sort(torch.randperm(question_start, generator=gen)[:50]).values,
                                              torch.arange(question_start, total)]),
        "question-only": torch.arange(question_start, total),
        "decode-row": torch.tensor([total - 1]),
    }[kind]
    cache = FusedCache(tf.num_layers, tf.num_kv_heads, tf.head_dim, total + 8, torch.float32, torch.device("cpu"))
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=gen))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=gen))
    cache.length = total
    stale = torch.sort(torch.randperm(question_start, generator=gen)[:150]).values
    cache.bias_keys(stale, -0.7, question_start)
    rows = Rows(positions, engine.rope, torch.float32, block_rows=16, biased_from=question_start)
    assert rows.last_biased
    q = torch.randn(1, tf.num_heads, positions.numel(), tf.head_dim, generator=gen)
    out = tf.attend(cache, 0, rows, q)
    bias = torch.zeros(total)
    bias[stale] = -0.7
    ref = _reference(q, cache.keys(0, total), cache.values(0, total), positions, tf.scale, bias, question_start)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    unbiased = _reference(q, cache.keys(0, total), cache.values(0, total), positions, tf.scale)
    assert not torch.allclose(out[:, -1], unbiased[:, -1], atol=1e-3)  # the bias did change the biased rows
