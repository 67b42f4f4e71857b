"""Scoring primitives and transformer row blocks (pure tensors, no model)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvfuse.fusion.methods import scoring


def test_budget_rounds_half_up_within_bounds():
    assert scoring.budget(0.15, 1000) == 150
    assert scoring.budget(0.5, 5) == 3
    assert scoring.budget(0.15, 7) == 1
    assert scoring.budget(1.0, 9) == 9 and scoring.budget(0.0, 9) == 0


def test_chunk_edges_cover_starts_and_ends_without_duplicates():
    assert scoring.chunk_edges([5, 3, 10], 2, 1).tolist() == [0, 1, 4, 5, 6, 7, 8, 9, 17]
    assert scoring.chunk_edges([4], 100, 100).tolist() == [0, 1, 2, 3]
    assert scoring.chunk_edges([6], 0, 0).numel() == 0


def test_smooth_is_a_same_length_moving_average():
    x = torch.tensor([0.0, 0.0, 5.0, 0.0, 0.0, 0.0])
    out = scoring.smooth(x, 5)
    assert out.shape == x.shape
    torch.testing.assert_close(out, torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0]))
    assert torch.equal(scoring.smooth(x, 1), x)


def test_top_k_returns_sorted_indices_of_the_largest():
    s = torch.tensor([0.1, 0.9, 0.3, 0.8, 0.2])
    assert scoring.top_k(s, 2).tolist() == [1, 3]
    assert scoring.top_k(s, 0).numel() == 0 and scoring.top_k(s, 9).tolist() == [0, 1, 2, 3, 4]


def test_attention_probs_match_sdpa_with_gqa():
    torch.manual_seed(0)
    q = torch.randn(1, 6, 4, 8)
    k, v = torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    positions = torch.tensor([6, 7, 8, 9])  # the last 4 of 10 positions, causal
    probs = scoring.attention_probs(q, positions, k, 8**-0.5)
    assert probs.shape == (6, 4, 10)
    torch.testing.assert_close(probs.sum(-1), torch.ones(6, 4))
    assert probs[:, 0, 7:].abs().max() == 0  # row at position 6 cannot see 7..9
    mask = positions[:, None] >= torch.arange(10)[None]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(scoring.apply_probs(probs, v), ref, atol=1e-5, rtol=1e-5)


def test_attention_probs_mask_scattered_unsorted_rows_by_their_own_positions():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 6, 4, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    positions = torch.tensor([9, 2, 5, 11])  # rows anywhere in the sequence, in any order
    probs = scoring.attention_probs(q, positions, k, 8**-0.5)
    mask = positions[:, None] >= torch.arange(12)[None]
    assert bool((probs[:, ~mask] == 0).all())
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(scoring.apply_probs(probs, v), ref, atol=1e-5, rtol=1e-5)


def test_value_deviation_is_the_per_token_norm():
    a, b = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4)
    b[0, 1, 2, 0] = 3.0
    b[0, 0, 2, 1] = 4.0
    assert scoring.value_deviation(a, b).tolist() == [0.0, 0.0, 5.0]
