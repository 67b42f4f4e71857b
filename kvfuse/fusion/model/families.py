"""The model families the engine computes, each as transformers' own modeling code does.

A family says how its decoder layer is wired, so that `Transformer.project` and `Transformer.finish`
(kvfuse/fusion/model/transformer.py) compute it with the HF module's own norms, projections, MLP and
rotary embedding; only attention is written out. What differs between families, read from each
family's `modeling_*.py` in transformers:

- `layout`: where the layer's norms sit. "pre": input norm before attention, post-attention norm before
  the MLP (Llama, Mistral, Qwen2/3, Phi-3). "sandwich": the input norm, then a norm of the attention
  output before its residual, a pre-feedforward norm and a norm of the MLP output before its residual
  (Gemma 2/3). "post": no norm on the layer's input; the attention output and the MLP output are each
  normed before their residual (OLMo 2).
- `qk_norm`: RMSNorm of q and k before RoPE: per head ("head": Qwen3, Gemma 3) or over the whole
  projection before it is split into heads ("projection": OLMo 2).
- `windows`: which layers attend through a sliding window: "layer_types" (the config's per-layer
  `layer_types`, `sliding_attention` ones: Qwen2/3 with `use_sliding_window`, Gemma 2/3), "all" (every
  layer when `sliding_window` is set: Mistral, Phi-3, Qwen3-MoE) or "none" (Llama, OLMo 2).
- `attn_softcap` / `final_softcap`: whether the family applies `attn_logit_softcapping` to attention
  logits (Gemma 2 only: Gemma 3's attention never passes it on) and `final_logit_softcapping` to the
  LM head's logits (Gemma 2 and 3).
- `attn_implementation`: transformers' attention the engine loads the model with, which computes the
  chunk caches at ingestion (`FusionEngine.precompute`) and the reference of the load check: SDPA, or
  eager where the family's SDPA path cannot soft-cap (Gemma 2).
- `kv_revision`: bumped when the engine changes how it computes a family's KV; it is part of the
  fingerprint (loading.fingerprint), so stored caches of the old computation become misses.

Fused qkv and gate/up projections (Phi-3), q/k/v biases (Qwen2), MoE MLPs (Qwen3-MoE), scaled embeddings
(Gemma) and tied embeddings need no entry: they live inside the HF modules the engine calls. docs/models.md
is rendered from this table (kvfuse/fusion/model/models_doc.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvfuse.fusion.errors import UnsupportedModelError


@dataclass(frozen=True)
class Family:
    model_type: str
    models: str  # the checkpoints users run, for the docs
    layout: Literal["pre", "sandwich", "post"] = "pre"
    qk_norm: Literal["head", "projection"] | None = None
    windows: Literal["none", "all", "layer_types"] = "none"
    attn_softcap: bool = False
    final_softcap: bool = False
    attn_implementation: str = "sdpa"
    notes: tuple[str, ...] = ()  # what else the family's modules carry, for the docs
    kv_revision: int = 0

    @property
    def norms(self) -> tuple[str, ...]:
        """The layer norm modules the layout calls (each layer must have them)."""
        return {"pre": ("input_layernorm", "post_attention_layernorm"),
                "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                             "post_feedforward_layernorm"),
                "post": ("post_attention_layernorm", "post_feedforward_layernorm")}[self.layout]


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "Llama 2, Llama 3.x (1B-70B), SmolLM2 (the default model)",
           notes=("llama3 RoPE scaling", "tied embeddings (Llama 3.2 1B/3B)", "q/k/v/o and MLP biases")),
    Family("mistral", "Mistral 7B", windows="all", notes=("a sliding window on every layer when set",)),
    Family("qwen2", "Qwen2, Qwen2.5", windows="layer_types",
           notes=("q/k/v bias", "sliding-window layers past `max_window_layers` when `use_sliding_window`")),
    Family("qwen3", "Qwen3 (0.6B-32B)", qk_norm="head", windows="layer_types",
           notes=("q/k RMSNorm per head before RoPE",)),
    Family("qwen3_moe", "Qwen3-30B-A3B, Qwen3-235B-A22B", qk_norm="head", windows="all",
           notes=("q/k RMSNorm per head before RoPE", "mixture-of-experts MLP (the HF module, token by token)")),
    Family("gemma2", "Gemma 2 (2B-27B)", layout="sandwich", windows="layer_types", attn_softcap=True,
           final_softcap=True, attn_implementation="eager",
           notes=("alternating sliding-window and global layers", "attention logit soft-capping",
                  "final logit soft-capping", "(1 + w) RMSNorm", "embeddings scaled by sqrt(hidden)",
                  "query scale from `query_pre_attn_scalar`", "head size 256")),
    Family("gemma3_text", "Gemma 3 1B, and the text model of Gemma 3 4B-27B", layout="sandwich", qk_norm="head",
           windows="layer_types", final_softcap=True,
           notes=("5 sliding-window layers to 1 global", "two RoPE bases (local 10k, global 1M) with their own scaling",
                  "q/k RMSNorm per head before RoPE", "(1 + w) RMSNorm", "embeddings scaled by sqrt(hidden)",
                  "query scale from `query_pre_attn_scalar`", "head size 256")),
    Family("phi3", "Phi-3-mini, Phi-3.5-mini, Phi-4-mini", windows="all",
           notes=("fused qkv projection", "fused gate/up projection", "partial rotary (Phi-4-mini: 3/4 of a head)",
                  "LongRoPE up to `original_max_position_embeddings`")),
    Family("olmo2", "OLMo 2 (1B-32B)", layout="post", qk_norm="projection",
           notes=("q/k RMSNorm over the whole projection before RoPE", "norms after attention and MLP, none before")),
)}

# Refused model types, with why (shown in the error and docs/models.md).
REFUSED: dict[str, str] = {
    "gemma3": ("the multimodal Gemma 3 (4B-27B) loads as an image-text model, not a causal LM: serve its text "
               "model, saved as a gemma3_text checkpoint (Gemma3ForCausalLM)"),
}


def family_of(config) -> Family:
    """The family of a transformers config; UnsupportedModelError names the supported types otherwise."""
    model_type = getattr(config, "model_type", None)
    if model_type in REFUSED:
        raise UnsupportedModelError(f"model type {model_type!r} is not supported: {REFUSED[model_type]}")
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported (supported: {sorted(FAMILIES)}; docs/models.md)") from None


def layer_windows(config, family: Family) -> list[int | None]:
    """Per layer, its sliding window (a query at p sees keys > p - window) or None for a global layer,
    by the rule transformers' modeling code of the family applies when it builds the masks."""
    layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    if not window or family.windows == "none" or int(window) >= int(config.max_position_embeddings):
        return [None] * layers  # (a window as long as the model's positions hides nothing: Phi-3.5's 262k)
    if family.windows == "all":
        return [int(window)] * layers
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) != layers:
        raise UnsupportedModelError(f"config.layer_types has {len(types)} entries for {layers} layers")
    return [int(window) if t == "sliding_attention" else None for t in types]


def rope_layer_types(config) -> list[str] | None:
    """Per layer, the layer type whose rope parameters it uses, for a model with one rotary embedding per
    layer type (Gemma 3); None when one rope serves every layer."""
    params = getattr(config, "rope_parameters", None) or {}
    types = list(getattr(config, "layer_types", None) or [])
    if types and all(isinstance(params.get(t), dict) for t in set(types)):
        return types
    return None
