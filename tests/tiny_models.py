"""Tiny random-weight models of every supported family, built from transformers' own config classes (no
hub), for the tests that prove each family against transformers' forward and serve it.

Each is small enough for a 2-core machine: hidden 64, 4 layers, the default model's vocabulary (its
tokenizer is reused). What a family is known for is switched on: Gemma's head size 256, alternating
sliding-window and global layers with a window of 24 (prompts in the tests are longer), Gemma 3's two
rope bases, Gemma 2's soft-capping, Phi-3's LongRoPE and partial rotary, Qwen3's q/k norms and (here)
its per-layer windows, Qwen2's q/k/v bias, Llama 3's rope scaling and tied embeddings, Mistral's
window on every layer, Qwen3-MoE's experts. Norm weights are perturbed (random init leaves them at one,
or at zero for Gemma's (1 + w) norms), so a norm applied in the wrong place shows.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers as T

WINDOW = 24
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0)
GEMMA = dict(head_dim=256, num_attention_heads=2, num_key_value_heads=1, sliding_window=WINDOW,
             query_pre_attn_scalar=128)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
LONGROPE_ORIGINAL = 256
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.05 * i for i in range(6)], "long_factor": [2.0 + 0.5 * i for i in range(6)]}

FAMILIES = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True)),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(sliding_window=32)),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, dict()),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(head_dim=32, use_sliding_window=True, sliding_window=32,
                                                      max_window_layers=2)),
    "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, dict(num_experts=4, num_experts_per_tok=2,
                                                                moe_intermediate_size=32)),
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, dict(GEMMA, attn_logit_softcapping=20.0,
                                                         final_logit_softcapping=10.0)),
    "gemma3_text": (T.Gemma3TextConfig, T.Gemma3ForCausalLM,
                    dict(GEMMA, layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                             "sliding_attention"],
                         rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                          "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0,
                                                             "factor": 8.0}})),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, dict(rope_parameters=LONGROPE, sliding_window=48,
                                                   original_max_position_embeddings=LONGROPE_ORIGINAL)),
    "olmo2": (T.Olmo2Config, T.Olmo2ForCausalLM, dict()),
}


def build(family: str, vocab: int, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> torch.nn.Module:
    """The tiny model of `family` (a key of FAMILIES), in eval mode; `overrides` change its config.
    dtype: its weights' (the float32 model's, rounded), as `from_pretrained(dtype=...)` loads them:
    buffers such as the rotary module's inv_freq stay float32."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(vocab_size=vocab, **{**SMALL, **extra, **overrides})
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            p.data = p.data.to(dtype)
    return model


def save(family: str, path: Path, tokenizer_dir: str | Path, **overrides) -> Path:
    """The tiny model saved as a checkpoint directory kvfuse can serve (the default model's tokenizer)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = build(family, len(tokenizer), **overrides)
    if path.exists():
        shutil.rmtree(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
