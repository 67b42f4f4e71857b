"""Token eviction of the fused cache after the first token (A³'s extension, SnapKV's selection).

Why: decode reads the weights once per step and every running sequence's whole cache, so on a
memory-bound device a long fused prompt slows every step and fills the KV budget. A³'s extension (its
paper's "Extension" section) keeps, once the fused prefill is done, the system prefix S and the question
Q whole and only the `C - |S| - |Q|` context tokens per layer and per KV head that the question attends
to most, and evicts the rest, once, before the second token. `fusion.evict_capacity` is C (0: off);
it applies after any method's prefill. See docs/methods/eviction.md.

Selection, as SnapKV (Li et al. 2024, `snapkv_utils.py`): the observation window is the question
(every question row, its assistant header included). At each layer the window's attention
probabilities over the keys before the window are summed over the window rows, max-pooled along the
keys with SnapKV's kernel (`SNAPKV_KERNEL`, stride 1, same length), and -- GQA -- summed over the query
heads that share a KV head; the top context keys of each KV head are kept. The window's queries are
not kept by the prefill, so they are recomputed: the question rows run once more through every layer
over the finished fused cache (reading it, writing nothing). At each layer that cache holds what those
rows saw in the prefill, so these are the prefill's own attention scores; the cost is |Q| rows per
layer, reported to the caller as prefill work (`evict_steps` yields after each layer).

The cache is compacted in place: per layer and per KV head the kept slots are gathered to the front, a
common length C (S, that head's kept context tokens in position order, Q), and the cache's capacity
shrinks to C plus the tokens still to generate, so the engine core gives the rest of the request's
extent back to the KV memory (engine/kv_memory.py).

Positions: every kept key keeps its original position. Its RoPE rotation was applied when it was
computed, so attention from any later query already sees the right relative distances; the evicted
tokens simply leave gaps. New tokens take the next original positions (`FusedCache.position_offset` =
prompt length - C), so a generated token's query and key are rotated as they would be without eviction.
Decode attention needs no mask over the gaps: a decode row sees every slot of its own cache, and which
slot a key sits in does not matter to attention (softmax over a set), only its rotation does.

Refused for models with sliding-window layers (`check_serves`): a local layer reads the keys of the last
`window` positions, which a compacted cache no longer keeps at known slots (docs/models.md).
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import replace

import torch
import torch.nn.functional as F

from kvfuse.fusion.errors import MethodRefusedError
from kvfuse.fusion.types import FusedPrefill, Layout

SNAPKV_KERNEL = 5  # SnapKV's max-pool kernel over the summed window attention (its default)


WINDOW_REFUSAL = ("eviction compacts the cache into fewer slots than positions, and a sliding-window layer reads "
                  "its keys by position")


def check_serves(engine, capacity: int) -> None:
    """Raise MethodRefusedError when eviction is asked of a model with sliding-window layers."""
    if capacity > 0 and any(w is not None for w in engine.tf.windows):
        raise MethodRefusedError(f"evict_capacity {capacity} cannot serve {engine.family.model_type} model: "
                                 f"{WINDOW_REFUSAL}")


def kept_count(layout: Layout, capacity: int) -> int:
    """Cache tokens after eviction: S and Q whole, up to C - |S| - |Q| context tokens (none when S and Q
    alone exceed C)."""
    budget = min(layout.context_len, max(0, capacity - layout.prefix_len - layout.question_len))
    return layout.prefix_len + budget + layout.question_len


def applies(layout: Layout, capacity: int) -> bool:
    """Whether eviction removes anything: C set and smaller than the prompt's context it could drop."""
    return capacity > 0 and kept_count(layout, capacity) < layout.total


def snapkv_scores(attn: torch.Tensor, window_start: int, kernel: int = SNAPKV_KERNEL) -> torch.Tensor:
    """SnapKV's per-KV-head score of each key before the window.

    attn: the window's attention probabilities [Hkv, G, W, T] (G query heads per KV head, W window rows,
    T keys). Returns [Hkv, window_start]: summed over the window rows, max-pooled over keys (stride 1,
    padding kernel // 2), summed over the G query heads of each KV head."""
    votes = attn[..., :window_start].sum(dim=2)  # [Hkv, G, window_start]
    pooled = F.max_pool1d(votes, kernel_size=kernel, padding=kernel // 2, stride=1)
    return pooled.sum(dim=1)


def select(scores: torch.Tensor, layout: Layout, capacity: int) -> torch.Tensor:
    """Slots to keep per KV head [Hkv, kept_count], in position order: S, the top-scored context keys
    of that head, Q. scores: [Hkv, question_start] (`snapkv_scores`)."""
    hkv = scores.shape[0]
    p, qs = layout.prefix_len, layout.question_start
    budget = kept_count(layout, capacity) - p - layout.question_len
    device = scores.device
    top = scores[:, p:qs].topk(budget, dim=-1).indices.sort(dim=-1).values + p
    return torch.cat([torch.arange(p, device=device).expand(hkv, p), top,
                      torch.arange(qs, layout.total, device=device).expand(hkv, layout.question_len)], dim=1)


def evict_steps(engine, fused: FusedPrefill, layout: Layout, question_ids: torch.Tensor, capacity: int
                ) -> Generator[int, None, FusedPrefill]:
    """Compact `fused.cache` in place to `kept_count(layout, capacity)` tokens (a no-op when `applies`
    is false). Yields the question rows run after each layer; returns the prefill with the compacted
    cache (the first-token logits are the full cache's: eviction happens after the first token)."""
    if not applies(layout, capacity):
        return fused
    t = time.perf_counter()
    tf, cache = engine.tf, fused.cache
    total, qs = layout.total, layout.question_start
    kept = kept_count(layout, capacity)
    rows = engine.rows(torch.arange(qs, total, device=cache.k.device))
    h = tf.embed(question_ids)
    hkv, w, d = tf.num_kv_heads, layout.question_len, tf.head_dim
    group = tf.num_heads // hkv
    for layer in range(engine.num_layers):
        q, _, _ = tf.project(layer, h, *rows.cos_sin(layer))  # [1, H, W, D]; K/V of these rows are cached
        keys, values = cache.k[layer, :, :total], cache.v[layer, :, :total]  # [Hkv, T, D]
        logits = torch.matmul(q[0].reshape(hkv, group * w, d).float(), keys.float().transpose(1, 2)) * tf.scale
        attn = torch.softmax(logits.view(hkv, group, w, total) + rows.mask.float(), dim=-1)
        idx = select(snapkv_scores(attn, qs), layout, capacity)  # [Hkv, kept]
        if layer < engine.num_layers - 1:  # the next layer's window queries, before this layer moves
            out = torch.matmul(attn.view(hkv, group * w, total).to(values.dtype), values)
            h = tf.finish(layer, h, out.view(1, tf.num_heads, w, d))
        gather = idx.unsqueeze(-1).expand(-1, -1, d)
        kept_k, kept_v = keys.gather(1, gather), values.gather(1, gather)  # copies: the slots overlap
        cache.k[layer, :, :kept] = kept_k
        cache.v[layer, :, :kept] = kept_v
        yield w
    cache.capacity = kept + cache.capacity - total
    cache.length = kept
    cache.position_offset = total - kept
    stats = dict(fused.stats, cache_tokens=kept, evicted_tokens=total - kept)
    timings = dict(fused.timings, evict_s=time.perf_counter() - t)
    return replace(fused, stats=stats, timings=timings)
