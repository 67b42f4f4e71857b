"""The `anchor` fusion method (kvfuse's default): exactness at r = 1, budget, anchors, and its scores
checked against an independent HF computation (question over the position-recovered cache, eager
attention weights)."""

from __future__ import annotations

import pytest
import torch
from fusion_helpers import hf_forward, to_dynamic_cache

from kvfuse.fusion import FusionOptions, GenerationOptions
from kvfuse.fusion.engine import solo
from kvfuse.fusion.methods import scoring
from kvfuse.fusion.methods.anchor import Anchor, evidence_scores, layer_window, spread

ATOL = 2e-4  # fp32 logits of a 30-layer model (as the engine's own tests)


# -- pure helpers (no model) ---------------------------------------------------------------------------
def test_layer_window_is_a_share_of_depth():
    assert layer_window(30, 0.24, 0.83) == range(7, 25)
    assert layer_window(30, 0.0, 1.0) == range(0, 30)
    assert layer_window(2, 0.9, 0.95) == range(1, 2)  # never empty, never past the last layer


def test_evidence_scores_give_every_head_the_same_vote():
    # head 0 leaves almost all its mass on an excluded sink (token 0); head 1 spreads over the content
    attn = torch.tensor([[[0.97, 0.03, 0.0, 0.0], [0.1, 0.0, 0.0, 0.9]]])  # [1 layer, 2 heads, 4 tokens]
    exclude = torch.tensor([True, False, False, False])
    s = evidence_scores(attn, exclude)
    assert s[0] == 0
    torch.testing.assert_close(s, torch.tensor([0.0, 0.5, 0.0, 0.5]))  # token 1 wins head 0 in full


def test_spread_lifts_neighbours_to_the_peak():
    s = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.2, 0.0])
    torch.testing.assert_close(spread(s, 3), torch.tensor([0.0, 1.0, 1.0, 1.0, 0.2, 0.2]))
    assert torch.equal(spread(s, 1), s)


# -- on the real model ------------------------------------------------------------------------------------
pytest_slow = pytest.mark.slow


@pytest_slow
def test_full_ratio_gives_vanilla_logits_and_continuation(engine, prompt, hf_greedy):
    ref = hf_forward(engine, prompt.ids, logits_to_keep=1).logits[0, -1].float()
    options = FusionOptions(method="anchor", recompute_ratio=1.0)
    fused = engine.fuse(prompt.prefix, prompt.chunks, prompt.question_ids, options)
    assert fused.stats["recomputed_tokens"] == fused.stats["context_tokens"]
    torch.testing.assert_close(fused.logits, ref, atol=ATOL, rtol=0)
    *_, result = solo.generate(engine, prompt.prefix, prompt.chunks, prompt.question_ids, options,
                                 GenerationOptions(max_tokens=len(hf_greedy)))
    assert result.token_ids == hf_greedy


@pytest_slow
@pytest.mark.parametrize(("ratio", "anchor_tokens"), [(0.15, 16), (0.4, 16), (0.15, 5)])
def test_selection_size_anchors_and_question_recomputed(engine, prompt, ratio, anchor_tokens):
    fused = engine.fuse(prompt.prefix, prompt.chunks, prompt.question_ids,
                        FusionOptions(method="anchor", recompute_ratio=ratio, anchor_tokens=anchor_tokens))
    p, lens = len(prompt.prefix), [len(c) for c in prompt.chunks]
    n = sum(lens)
    sel = fused.selected.tolist()
    budget = round(ratio * n)
    assert len(sel) == budget == fused.stats["recomputed_tokens"]
    assert sel == sorted(set(sel)) and sel[0] >= p and sel[-1] < p + n
    anchors, start = [], p
    for length in lens:
        anchors += list(range(start, start + min(anchor_tokens, length)))
        start += length
    if budget >= len(anchors):
        assert set(anchors) <= set(sel)
    else:  # a budget smaller than the anchors is spent on anchors, chunk by chunk
        assert sel == anchors[:budget]
    # The question rows were recomputed over the fused cache: the logits equal a fresh HF forward of the
    # question over the fused context cache.
    q_start = p + n
    past = to_dynamic_cache(fused.cache.k[:, :, :q_start], fused.cache.v[:, :, :q_start])
    with torch.inference_mode():
        out = engine.model(torch.tensor([prompt.question_ids]), past_key_values=past, logits_to_keep=1)
    torch.testing.assert_close(fused.logits, out.logits[0, -1].float(), atol=ATOL, rtol=0)


@pytest.fixture()
def eager_attention(engine):
    engine.model.set_attn_implementation("eager")
    yield
    engine.model.set_attn_implementation("sdpa")


@pytest_slow
@pytest.mark.parametrize("anchor_tokens", [16, 0])
def test_evidence_is_windowed_head_normalised_question_attention(engine, prompt, eager_attention, anchor_tokens):
    """Reference: the question alone over the position-recovered cache (HF forward, eager attention
    weights); per window layer and head, attention onto the non-anchor context renormalised, averaged,
    max-pooled; the top tokens after the anchors fill the budget."""
    ratio = 0.5
    pie = engine.fuse(prompt.prefix, prompt.chunks, prompt.question_ids, FusionOptions(method="pie"))
    qn, p = len(prompt.question_ids), len(prompt.prefix)
    q_start = len(prompt.ids) - qn
    n = q_start - p
    past = to_dynamic_cache(pie.cache.k[:, :, :q_start], pie.cache.v[:, :, :q_start])
    with torch.inference_mode():
        out = engine.model(torch.tensor([prompt.question_ids]), past_key_values=past, output_attentions=True,
                           logits_to_keep=1)
    layers = layer_window(engine.num_layers, *Anchor.window)
    head_attn = torch.stack([out.attentions[i][0, :, :, p:q_start].float().mean(dim=1) for i in layers])
    anchors = scoring.chunk_edges([len(c) for c in prompt.chunks], anchor_tokens, 0)
    is_anchor = torch.zeros(n, dtype=torch.bool)
    is_anchor[anchors] = True
    scores = spread(evidence_scores(head_attn, is_anchor), Anchor.neighbours).masked_fill(is_anchor, -1.0)
    rest = round(ratio * n) - anchors.numel()
    expected = torch.sort(torch.cat([anchors, torch.topk(scores, rest).indices])).values + p
    fused = engine.fuse(prompt.prefix, prompt.chunks, prompt.question_ids,
                        FusionOptions(method="anchor", recompute_ratio=ratio, anchor_tokens=anchor_tokens))
    assert fused.selected.tolist() == expected.tolist()
    # Its evidence coverage: the share of the (unspread) votes on the tokens it recomputes.
    votes = evidence_scores(head_attn, is_anchor)
    chosen = (fused.selected - p)
    assert fused.stats["evidence_coverage"] == pytest.approx(float(votes[chosen].sum()), abs=1e-4)


@pytest_slow
def test_evidence_coverage_grows_with_the_ratio_to_all_of_it(engine, prompt):
    cover = [engine.fuse(prompt.prefix, prompt.chunks, prompt.question_ids,
                         FusionOptions(method="anchor", recompute_ratio=r)).stats["evidence_coverage"]
             for r in (0.05, 0.15, 0.5, 1.0)]
    assert 0.0 <= cover[0] <= cover[1] <= cover[2] <= cover[3]
    assert cover[3] == pytest.approx(1.0, abs=1e-5)
