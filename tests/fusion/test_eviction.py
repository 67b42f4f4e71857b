"""Eviction after the first token (fusion/eviction.py): a capacity that holds the prompt changes nothing;
a small one keeps, per layer and KV head, exactly SnapKV's tokens (checked against the model's own
eager attention probabilities); the kept keys decode at their original positions (the same logits as
the full cache with the evicted keys masked out); memory drops with C; and an evicted sequence decodes
its own tokens in a batch beside un-evicted ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fusion_helpers import make_prompt

from kvfuse.fusion import FusionOptions
from kvfuse.fusion.eviction import SNAPKV_KERNEL

pytestmark = pytest.mark.slow

STEPS = 6


def _fuse(engine, prompt, capacity, method="anchor", max_tokens=STEPS):
    return engine.fuse(prompt.prefix, prompt.chunks, prompt.question_ids,
                       FusionOptions(method=method, recompute_ratio=0.3, evict_capacity=capacity),
                       max_tokens=max_tokens)


def _greedy(engine, fused, steps=STEPS) -> tuple[list[int], list[torch.Tensor]]:
    tokens, rows = [int(torch.argmax(fused.logits))], []
    for _ in range(steps - 1):
        rows.append(engine.decode_step(fused.cache, tokens[-1]))
        tokens.append(int(torch.argmax(rows[-1])))
    return tokens, rows


def _kept_slots(full, evicted) -> torch.Tensor:
    """[L, Hkv, C]: which slot of the full cache each kept key came from (found by exact equality: the
    kept keys are copies, and no two positions share a rotated key)."""
    n, c = full.length, evicted.length
    old, new = full.k[:, :, :n], evicted.k[:, :, :c]
    match = (new.unsqueeze(3) == old.unsqueeze(2)).all(-1)  # [L, Hkv, C, n]
    assert (match.sum(-1) == 1).all(), "every kept key is exactly one prompt key"
    return match.int().argmax(-1)


@pytest.mark.parametrize("method", ["anchor", "vanilla", "a3"])
def test_capacity_at_least_the_prompt_changes_nothing(engine, prompt, method):
    ref = _fuse(engine, prompt, 0, method)
    ref_tokens, ref_rows = _greedy(engine, ref)
    for capacity in (len(prompt.ids), 10 * len(prompt.ids)):
        fused = _fuse(engine, prompt, capacity, method)
        assert fused.cache.length == len(prompt.ids) and fused.cache.position_offset == 0
        tokens, rows = _greedy(engine, fused)
        assert tokens == ref_tokens
        for a, b in zip(rows, ref_rows, strict=True):
            assert torch.equal(a, b)


def _direct_snapkv(engine, ids, layout_parts, capacity) -> list[list[set[int]]]:
    """SnapKV computed directly from the HF model's eager attention probabilities: per layer and KV head
    the kept context positions."""
    from transformers import AutoModelForCausalLM

    p, n, q = layout_parts
    qs = p + n
    model = AutoModelForCausalLM.from_pretrained(engine.model.name_or_path, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.inference_mode():
        attentions = model(torch.tensor([ids]), output_attentions=True).attentions
    hkv = engine.num_kv_heads
    budget = capacity - p - q
    out = []
    for attn in attentions:  # [1, H, T, T]
        votes = attn[0, :, qs:, :qs].sum(dim=1)  # [H, qs]: the window's rows summed
        pooled = torch.stack([votes[:, max(0, j - SNAPKV_KERNEL // 2): j + SNAPKV_KERNEL // 2 + 1].amax(-1)
                              for j in range(qs)], dim=1)
        score = pooled.view(hkv, -1, qs).sum(1)  # the query heads of each KV head
        out.append([(score[h, p:], set((score[h, p:].topk(budget).indices + p).tolist())) for h in range(hkv)])
    return out


def test_small_capacity_keeps_snapkv_tokens_per_layer_and_kv_head(engine, prompt):
    assert engine.tf.num_heads > engine.num_kv_heads  # GQA: several query heads per KV head
    p, n, q = len(prompt.prefix), sum(len(c) for c in prompt.chunks), len(prompt.question_ids)
    capacity = p + q + n // 3
    full = _fuse(engine, prompt, 0, "vanilla")  # vanilla: the fused cache is the model's own
    evicted = _fuse(engine, prompt, capacity, "vanilla")
    assert evicted.cache.length == capacity and evicted.stats["evicted_tokens"] == len(prompt.ids) - capacity
    slots = _kept_slots(full.cache, evicted.cache)
    direct = _direct_snapkv(engine, prompt.ids, (p, n, q), capacity)
    exact = 0
    for layer in range(engine.num_layers):
        for h in range(engine.num_kv_heads):
            kept = slots[layer, h].tolist()
            assert kept[:p] == list(range(p)) and kept[-q:] == list(range(p + n, p + n + q))  # S and Q whole
            assert kept == sorted(kept)  # position order
            ctx = set(kept[p:-q])
            scores, ref = direct[layer][h]
            exact += ctx == ref
            if ctx != ref:  # only a near-tie at the cut may differ (eager vs our attention, float32)
                cut = scores.topk(n // 3).values[-1]
                for i in ctx ^ ref:
                    assert abs(float(scores[i - p] - cut)) < 1e-5 * max(1.0, float(cut)), (layer, h, i)
    assert exact >= 0.95 * engine.num_layers * engine.num_kv_heads


def _masked_decode(engine, cache, kept, prompt_len, token_id):
    """One decode step over the full cache with the evicted prompt keys masked per layer and KV head
    (the reference for decoding the compacted cache): logits [vocab]; appends to `cache`."""
    tf = engine.tf
    pos = cache.length
    cos, sin = (t.view(1, 1, 1, -1) for t in engine.rope.cos_sin(torch.tensor([pos]), tf.dtype))
    h = tf.embed_tokens(torch.tensor([[token_id]]))
    group = tf.num_heads // tf.num_kv_heads
    for layer in range(tf.num_layers):
        qv, k, v = tf.project(layer, h, cos, sin)
        cache.write(layer, torch.tensor([pos]), k, v)
        mask = torch.full((tf.num_kv_heads, pos + 1), -torch.inf)
        mask.scatter_(1, kept[layer], 0.0)
        mask[:, prompt_len:] = 0.0  # generated tokens are never evicted
        mask = mask.repeat_interleave(group, 0).view(1, tf.num_heads, 1, pos + 1)
        out = F.scaled_dot_product_attention(qv, cache.keys(layer, pos + 1), cache.values(layer, pos + 1),
                                             attn_mask=mask, scale=tf.scale, enable_gqa=True)
        h = tf.finish(layer, h, out)
    cache.length += 1
    return tf.logits(h[:, -1])[0]


def test_evicted_cache_decodes_at_original_positions(engine, prompt):
    capacity = len(prompt.prefix) + len(prompt.question_ids) + 40
    full = _fuse(engine, prompt, 0)
    evicted = _fuse(engine, prompt, capacity)
    assert evicted.cache.position_offset == len(prompt.ids) - capacity
    kept = _kept_slots(full.cache, evicted.cache)
    token = int(torch.argmax(evicted.logits))
    assert token == int(torch.argmax(full.logits))  # the first token comes from the full cache
    with torch.inference_mode():
        for _ in range(STEPS - 1):
            row = engine.decode_step(evicted.cache, token)
            ref = _masked_decode(engine, full.cache, kept, len(prompt.ids), token)
            torch.testing.assert_close(row, ref, atol=1e-4, rtol=0)
            token = int(torch.argmax(row))
    assert evicted.cache.next_position == full.cache.length


def test_memory_drops_as_capacity_does(engine, prompt):
    p, q = len(prompt.prefix), len(prompt.question_ids)
    sizes = [_fuse(engine, prompt, c).cache for c in (0, p + q + 120, p + q + 60, p + q + 10, 1)]
    assert [c.length for c in sizes] == [len(prompt.ids), p + q + 120, p + q + 60, p + q + 10, p + q]
    nbytes = [c.nbytes for c in sizes]
    assert nbytes == sorted(nbytes, reverse=True) and len(set(nbytes)) == len(nbytes)
    per_token = nbytes[0] / sizes[0].capacity
    assert all(c.nbytes == per_token * c.capacity for c in sizes)  # a real, smaller tensor
    assert all(c.capacity - c.length == STEPS for c in sizes)  # room for the answer stays


def test_evicted_and_full_sequences_in_one_batch_decode_their_solo_tokens(engine, prompt, essays):
    texts = dict(essays)
    other = make_prompt(engine, list(texts.values())[7], "What is the main point?", [90, 20, 41, 12])
    small = len(prompt.prefix) + len(prompt.question_ids) + 30
    runs = [(prompt, small), (other, 0), (other, len(other.prefix) + len(other.question_ids) + 50), (prompt, 0)]
    solo = [_greedy(engine, _fuse(engine, p, c)) for p, c in runs]
    fused = [_fuse(engine, p, c) for p, c in runs]
    assert len({f.cache.length for f in fused}) == len(runs)  # different cache lengths in one batch
    tokens = [[int(torch.argmax(f.logits))] for f in fused]
    for step in range(STEPS - 1):
        logits = engine.decode_batch([f.cache for f in fused], torch.tensor([t[-1] for t in tokens]))
        for i, (_, solo_rows) in enumerate(solo):
            torch.testing.assert_close(logits[i], solo_rows[step], atol=1e-4, rtol=0)
            tokens[i].append(int(torch.argmax(logits[i])))
    assert tokens == [t for t, _ in solo]
