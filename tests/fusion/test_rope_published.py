"""The rope self-test passes on the published configs of every family's real models, at their full
positions: the attention and rope values of each model's config.json (as published; no download),
loaded by transformers' own config class with one tiny layer of each type, then built into the engine's
Transformer, which builds and self-tests a Rope per rotary embedding (kvfuse/fusion/model/rope.py).

The configs keep everything the rotation depends on: head_dim (hidden_size is one head of it),
partial_rotary_factor, rope_theta / rope_local_base_freq, rope_scaling and max_position_embeddings
(original_max_position_embeddings for LongRoPE, whose rotation stored caches carry only up to it).
LongRoPE's factor lists are Phi-3.5-mini-instruct's (48 each) and Phi-4-mini-instruct's (48 each, for its
96 rotary dimensions); Phi-3-mini-128k's own lists have the same length and range."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from kvfuse.fusion.model.transformer import Transformer

LLAMA3_8B_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}
PHI35_SHORT = [1.0, 1.02, 1.03, 1.03, 1.05, 1.05, 1.05, 1.05, 1.05, 1.07, 1.1, 1.11, 1.16, 1.16, 1.17, 1.29, 1.34,
               1.68, 1.79, 1.82, 1.85, 1.88, 1.91, 1.94, 1.99, 2.02, 2.02, 2.02, 2.02, 2.02, 2.02, 2.03, 2.03, 2.03,
               2.03, 2.03, 2.03, 2.03, 2.03, 2.03, 2.08, 2.09, 2.19, 2.22, 2.59, 2.73, 2.75, 2.84]
PHI35_LONG = [1.08, 1.11, 1.14, 1.34, 1.59, 1.6, 1.62, 2.62, 3.23, 3.23, 4.79, 7.4, 7.7, 9.09, 12.2, 17.67, 24.46,
              28.57, 30.42, 30.84, 32.59, 32.93, 42.32, 44.96, 50.34, 50.45, 57.55, 57.93, 58.21, 60.14, 62.61, 62.62,
              62.71, 63.14, 63.14, 63.77, 63.93, 63.96, 63.97, 64.03, 64.07, 64.08, 64.12, 64.41, 64.48, 64.51, 64.53,
              64.84]
PHI4_LONG = [1.0, 1.1183, 1.2506, 1.3986, 1.5641, 1.7492, 1.9561, 2.1876, 2.4464, 2.7359, 3.0596, 3.4216, 3.8265,
             4.2792, 4.7855, 5.3517, 5.985, 6.6931, 7.485, 8.3707, 9.3611, 10.4687, 11.7074, 13.0926, 14.6417,
             16.3742, 18.3116, 20.4782, 22.9012, 25.6109, 28.6412, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66,
             32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77]
GEMMA3_LARGE = dict(rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling={"factor": 8.0, "rope_type": "linear"},
                    max_position_embeddings=131072, sliding_window=1024, sliding_window_pattern=6)

# name: (config class, model class, config.json's rope/attention values); positions served (None: max_position_embeddings)
PUBLISHED = {
    "Llama-3.1-8B": (T.LlamaConfig, T.LlamaForCausalLM, dict(
        head_dim=128, rope_theta=500000.0, max_position_embeddings=131072, rope_scaling=LLAMA3_8B_SCALING)),
    "Llama-3.2-1B": (T.LlamaConfig, T.LlamaForCausalLM, dict(
        head_dim=64, rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling={**LLAMA3_8B_SCALING, "factor": 32.0})),
    "Qwen2.5-7B": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(
        head_dim=128, rope_theta=1000000.0, max_position_embeddings=131072, sliding_window=131072,
        use_sliding_window=False, max_window_layers=28)),
    "Qwen3-8B": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(
        head_dim=128, rope_theta=1000000.0, max_position_embeddings=40960, use_sliding_window=False)),
    "gemma-2-2b": (T.Gemma2Config, T.Gemma2ForCausalLM, dict(
        head_dim=256, rope_theta=10000.0, max_position_embeddings=8192, sliding_window=4096, query_pre_attn_scalar=256,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, num_hidden_layers=2)),
    "gemma-2-9b": (T.Gemma2Config, T.Gemma2ForCausalLM, dict(
        head_dim=256, rope_theta=10000.0, max_position_embeddings=8192, sliding_window=4096, query_pre_attn_scalar=256,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, num_hidden_layers=2)),
    "gemma-3-270m": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, dict(
        head_dim=256, rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling=None,
        max_position_embeddings=32768, sliding_window=512, sliding_window_pattern=6, num_hidden_layers=6)),
    "gemma-3-1b": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, dict(
        head_dim=256, rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling=None,
        max_position_embeddings=32768, sliding_window=512, sliding_window_pattern=6, num_hidden_layers=6)),
    "gemma-3-4b (text)": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, dict(GEMMA3_LARGE, head_dim=256,
                                                                        num_hidden_layers=6)),
    "gemma-3-27b (text)": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, dict(GEMMA3_LARGE, head_dim=128,
                                                                         query_pre_attn_scalar=168, num_hidden_layers=6)),
    "Phi-3-mini-4k": (T.Phi3Config, T.Phi3ForCausalLM, dict(
        head_dim=96, rope_theta=10000.0, max_position_embeddings=4096, original_max_position_embeddings=4096,
        sliding_window=2047, rope_scaling=None)),
    "Phi-3-mini-128k": (T.Phi3Config, T.Phi3ForCausalLM, dict(
        head_dim=96, rope_theta=10000.0, max_position_embeddings=131072, original_max_position_embeddings=4096,
        sliding_window=262144, rope_scaling={"type": "longrope", "short_factor": PHI35_SHORT,
                                             "long_factor": PHI35_LONG})),
    "Phi-4-mini": (T.Phi3Config, T.Phi3ForCausalLM, dict(
        head_dim=128, partial_rotary_factor=0.75, rope_theta=10000.0, max_position_embeddings=131072,
        original_max_position_embeddings=4096, sliding_window=262144, tie_word_embeddings=True,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": PHI4_LONG})),
    "Mistral-7B-v0.3": (T.MistralConfig, T.MistralForCausalLM, dict(
        head_dim=128, rope_theta=1000000.0, max_position_embeddings=32768, sliding_window=None)),
    "OLMo-2-7B": (T.Olmo2Config, T.Olmo2ForCausalLM, dict(
        head_dim=128, rope_theta=500000.0, max_position_embeddings=4096)),
}
LONGROPE_SERVED = {"Phi-3-mini-128k": 4096, "Phi-4-mini": 4096}  # original_max_position_embeddings


def tiny(config_cls, model_cls, published: dict) -> torch.nn.Module:
    """The published rope/attention values on one head per layer (hidden_size = head_dim), tiny otherwise."""
    values = {"vocab_size": 16, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 1,
              "num_key_value_heads": 1, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **published}
    values["hidden_size"] = values["head_dim"]
    return model_cls(config_cls.from_dict(values))


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_rope_check_passes_on_the_published_config_at_full_positions(name: str) -> None:
    config_cls, model_cls, published = PUBLISHED[name]
    tf = Transformer(tiny(config_cls, model_cls, published))  # every Rope self-tests as it is built
    served = LONGROPE_SERVED.get(name, published["max_position_embeddings"])
    ropes = {id(r): r for r in (tf.rope_of(i) for i in range(tf.num_layers))}.values()
    assert {r.max_positions for r in ropes} == {served}
    rotary = int(published["head_dim"] * published.get("partial_rotary_factor", 1.0))
    assert {r.dim for r in ropes} == {rotary}
    if config_cls is T.Gemma3TextConfig:  # one rope per layer type, each checked
        assert sorted(r.layer_type for r in ropes) == ["full_attention", "sliding_attention"]
        assert tf.windows.count(None) == 1
