"""Loading a causal LM of a supported family (kvfuse/fusion/model/families.py) and identifying it (the
fingerprint that keys stored KV)."""

from __future__ import annotations

import hashlib
import json

import torch

from kvfuse.fusion.model import families, rope

SUPPORTED_MODEL_TYPES = frozenset(families.FAMILIES)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Config keys that name where or how a model was saved, not what it computes.
_CONFIG_NOT_IDENTITY = frozenset({"_name_or_path", "transformers_version", "dtype", "torch_dtype", "_commit_hash"})
_FINGERPRINT_SAMPLES = 64  # values hashed per tensor (head, and a stride through the whole tensor)


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def check_supported(config) -> families.Family:
    """The config's family; UnsupportedModelError (naming the supported types) when there is none."""
    return families.family_of(config)


def attn_implementation(config) -> str:
    """transformers' attention the model is loaded with (its chunk caches and the load check's reference)."""
    return families.family_of(config).attn_implementation


def context_limit(config, override: int = 0) -> int:
    """Longest prompt + completion the engine serves: the model's position limit, the length a
    length-dependent rope stays the rotation stored caches carry (LongRoPE: `rope.valid_length`), and
    the override. A sliding window bounds nothing: local layers attend to their window at any length."""
    limits = [int(config.max_position_embeddings)]
    bound, _ = context_bound(config)
    if bound:
        limits.append(bound)
    if override > 0:
        limits.append(override)
    return min(limits)


def context_bound(config) -> tuple[int | None, str]:
    """(tokens, why) of the tightest bound below max_position_embeddings that the model's rope sets
    (None, "" when there is none)."""
    bounds = [rope.valid_length(config, t) for t in (families.rope_layer_types(config) or [None])]
    bounds = [b for b in bounds if b[0] is not None]
    return min(bounds) if bounds else (None, "")


def fingerprint(model: torch.nn.Module, tokenizer, dtype: str) -> str:
    """sha256 over (weights identity, dtype, tokenizer vocab and chat template, model config, the
    family's KV revision). The config holds everything else that changes the KV: the layer types and
    windows, every rope parameter (bases, scaling, LongRoPE factors, partial rotary), soft-capping, norm
    epsilons, the query scale.

    Weights identity: every tensor's name, shape and dtype plus a sample of its values (its first
    values and a stride through the whole tensor), cheap at load and independent of the file format.
    """
    h = hashlib.sha256()
    h.update(f"dtype={dtype}\n".encode())
    revision = families.family_of(model.config).kv_revision
    if revision:  # how the engine computes the family's KV (revision 0 leaves the older fingerprints as they were)
        h.update(f"kv_revision={revision}\n".encode())
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
