"""The per-cache decode step: B sequences, each over its own `FusedCache`, one attention call apiece.

The reference the pooled step (`model_runner.py`) is tested against, and the step of the callers that
hold a fused cache rather than a pool slot: `FusionEngine.decode_step` / `decode_batch` (the batch of
one in `generate`, the fidelity and eviction benchmarks). docs/DESIGN.md, "Decoding".
"""

from __future__ import annotations

import torch

from kvfuse.fusion.cache import FusedCache
from kvfuse.fusion.errors import FusionError


def decode_caches(tf, caches: list[FusedCache], token_ids: torch.Tensor) -> torch.Tensor:
    """One decode step for B sequences with the layers of `tf` (kvfuse.fusion.model.transformer.Transformer):
    token_ids [B] -> logits [B, vocab] (fp32).

    The B new tokens go through embedding, norms, projections and MLP as one matrix [B, 1, hidden]
    (the weights are read once per step, whatever B). Each token is rotated to its own sequence's
    position (its cache's `next_position`: `length`, or further on after eviction), its K/V written
    at slot `length`, and it attends over its own cache alone; then every cache's `length` grows by
    one. The caches may differ in length (an evicted one is shorter)."""
    full = [i for i, c in enumerate(caches) if c.length >= c.capacity]
    if full:
        raise FusionError(f"the fused cache of sequence {full[0]} is full")
    slots = torch.tensor([c.length for c in caches], device=token_ids.device)
    positions = torch.tensor([c.next_position for c in caches], device=token_ids.device)
    cos, sin = (t.view(-1, 1, 1, t.shape[-1]) for t in tf.rope.cos_sin(positions, tf.dtype))  # [B, 1, 1, D]
    h = tf.embed_tokens(token_ids.view(-1, 1))  # [B, 1, hidden]
    for layer in range(tf.num_layers):
        q, k, v = tf.project(layer, h, cos, sin)  # [B, H | Hkv, 1, D]
        outs = []
        for i, cache in enumerate(caches):
            cache.write(layer, slots[i : i + 1], k[i : i + 1], v[i : i + 1])
            end = cache.length + 1
            outs.append(tf.attend_all(q[i : i + 1], cache.keys(layer, end), cache.values(layer, end)))
        h = tf.finish(layer, h, torch.cat(outs))
    for cache in caches:
        cache.length += 1
    return tf.logits(h[:, -1])
