"""Loading a Llama/Mistral/Qwen2-family causal LM and identifying it (the fingerprint that keys stored KV)."""

from __future__ import annotations

import hashlib
import json

import torch

from kvfuse.fusion.errors import UnsupportedModelError

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Config keys that name where or how a model was saved, not what it computes.
_CONFIG_NOT_IDENTITY = frozenset({"_name_or_path", "transformers_version", "dtype", "torch_dtype", "_commit_hash"})
_FINGERPRINT_SAMPLES = 64  # values hashed per tensor (head, and a stride through the whole tensor)


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def check_supported(config) -> None:
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {config.model_type!r} is not supported (supported: {sorted(SUPPORTED_MODEL_TYPES)})"
        )


def attention_window(config) -> int | None:
    """The sliding attention window if any layer uses one (Mistral: every layer when set)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    if config.model_type == "mistral":
        return int(window)
    layer_types = getattr(config, "layer_types", None) or []
    return int(window) if "sliding_attention" in layer_types else None


def context_limit(config, override: int = 0) -> int:
    """Longest prompt + completion the engine serves: the model's position limit, the sliding window
    (beyond it vanilla attention would drop keys, which fused caches do not model), and the override."""
    limits = [int(config.max_position_embeddings)]
    window = attention_window(config)
    if window:
        limits.append(window)
    if override > 0:
        limits.append(override)
    return min(limits)


def fingerprint(model: torch.nn.Module, tokenizer, dtype: str) -> str:
    """sha256 over (weights identity, dtype, tokenizer vocab and chat template, model config).

    Weights identity: every tensor's name, shape and dtype plus a sample of its values (its first
    values and a stride through the whole tensor), cheap at load and independent of the file format.
    """
    h = hashlib.sha256()
    h.update(f"dtype={dtype}\n".encode())
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // _FINGERPRINT_SAMPLES)
        sample = torch.cat([flat[:_FINGERPRINT_SAMPLES], flat[::step][:_FINGERPRINT_SAMPLES]])
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}\n".encode())
        h.update(sample.float().cpu().numpy().tobytes())
    vocab = sorted(tokenizer.get_vocab().items())
    h.update(json.dumps(vocab, ensure_ascii=False).encode())
    h.update(str(getattr(tokenizer, "chat_template", "") or "").encode())
    config = {k: v for k, v in model.config.to_dict().items() if k not in _CONFIG_NOT_IDENTITY}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    return h.hexdigest()
