"""The rope self-test (`Rope._check_composes`) judges the rotary module, not float rounding: a true
rotation passes at every position the model has, however long (its float32 angle error grows with the
position, and the tolerance with it, kvfuse/fusion/model/rope.py `composition_tolerance`), while a rope
whose angle is not a fixed linear function of the position fails under an allowed name. The keys the
served path shifts stay within the same bound."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kvfuse.fusion.errors import UnsupportedModelError
from kvfuse.fusion.model.rope import Rope, apply_rope, composition_tolerance

CPU = torch.device("cpu")
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=1,
            num_key_value_heads=1)


def gemma3_270m_like() -> T.Gemma3TextConfig:
    """google/gemma-3-270m's attention geometry: head dim 256, sliding base 10k, global 1M, 32,768 positions."""
    return T.Gemma3TextConfig(**{**TINY, "num_hidden_layers": 6}, head_dim=256, max_position_embeddings=32768,
                              sliding_window=512, rope_parameters={
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                  "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})


def gemma3_ropes(config) -> dict[str, Rope]:
    rotary = T.Gemma3ForCausalLM(config).model.rotary_emb
    return {t: Rope(rotary, config, CPU, layer_type=t) for t in ("sliding_attention", "full_attention")}


def composition_error(rope: Rope, p: int, d: int) -> tuple[float, float]:
    """(largest |R(d) R(p) x - R(p + d) x|, the largest ratio of an element's error to its tolerance) on
    the self-test's vectors."""
    x = torch.randn(4, rope.dim, generator=torch.Generator().manual_seed(0))
    (cp, sp), (cd, sd), (c, s) = (rope.shift_cos_sin(q) for q in (p, d, p + d))
    err = (apply_rope(apply_rope(x, cp, sp), cd, sd) - apply_rope(x, c, s)).abs()
    tol = composition_tolerance(x, rope.frequencies(), p, d, torch.float32)
    return float(err.max()), float((err / tol).max())


def test_gemma3_at_its_32k_positions_passes_on_real_float32_angle_error() -> None:
    """The case a fixed 1e-3 refused: the sliding layers at (8191, 16383) differ by more than that, and it
    is the rounding of a true rotation (the bound holds it)."""
    ropes = gemma3_ropes(gemma3_270m_like())  # constructing them runs the self-test
    assert ropes["sliding_attention"].max_positions == 32768
    err, ratio = composition_error(ropes["sliding_attention"], 8191, 16383)
    assert err > 1e-3 and ratio <= 1
    err, ratio = composition_error(ropes["sliding_attention"], 3, 5)
    assert err < 1e-5 and ratio <= 1


def test_a_dynamic_rope_under_an_allowed_name_is_refused() -> None:
    """transformers' own dynamic-NTK module (its frequencies change past 2,048 positions) in a config that
    calls its rope "default" at 32,768 positions: rotations at long positions no longer compose."""
    dynamic = T.LlamaConfig(**TINY, head_dim=64, max_position_embeddings=2048,
                            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})
    claimed = T.LlamaConfig(**TINY, head_dim=64, max_position_embeddings=32768)
    assert claimed.rope_parameters["rope_type"] == "default"
    with pytest.raises(UnsupportedModelError, match=r"does not compose across positions: rotating by \d+ then by"):
        Rope(LlamaRotaryEmbedding(dynamic), claimed, CPU)
    Rope(LlamaRotaryEmbedding(claimed), claimed, CPU)  # the true module of that config passes


class FakeQuadraticRope(LlamaRotaryEmbedding):
    """A fake: a rotary module whose angle is p * f * (1 + p * 1e-9), i.e. scaled by a factor that grows
    with the position. No shipped rope does this; it stands for a custom scaled variant whose angle is
    not linear in the position, off linear by a part in a million at 1,000 positions."""

    def forward(self, x, position_ids):
        p = position_ids[..., None].double()
        freqs = (p * (1 + p * 1e-9) * self.inv_freq.double()).float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def test_a_rope_whose_angle_is_not_linear_in_the_position_is_refused() -> None:
    config = T.LlamaConfig(**TINY, head_dim=64, max_position_embeddings=32768)
    with pytest.raises(UnsupportedModelError, match="does not compose across positions") as err:
        Rope(FakeQuadraticRope(config), config, CPU)
    assert "float rounding of a true rotation allows" in str(err.value)


def test_shifted_keys_stay_within_the_bound_the_check_allows() -> None:
    """The served path: keys computed at 0..n-1 (as the model rotates them), moved by `shift_keys_` to the
    end of the model's positions, against the keys computed there; and moved back (position recovery of
    a chunk cached after its context). Each row within `composition_tolerance` of its positions."""
    rope = gemma3_ropes(gemma3_270m_like())["sliding_attention"]
    n = 64
    delta = rope.max_positions - n
    x = torch.randn(1, n, rope.dim, generator=torch.Generator().manual_seed(3))
    at = {}
    for start in (0, delta):
        cos, sin = rope.cos_sin(torch.arange(start, start + n), torch.float32)
        at[start] = apply_rope(x, cos[0], sin[0])
    freq = rope.frequencies()
    tol = composition_tolerance(x, freq, n - 1, delta, torch.float32)  # rows 0..n-1: the largest p
    moved = at[0].clone()
    rope.shift_keys_(moved, delta)
    back = at[delta].clone()
    rope.shift_keys_(back, -delta)
    assert bool(((moved - at[delta]).abs() <= tol).all())
    assert bool(((back - at[0]).abs() <= tol).all())
    assert float((moved - at[delta]).abs().max()) > 1e-4  # the error is real at these positions, not zero
