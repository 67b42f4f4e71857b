"""Random KV of the default model's shapes for the store tests (no LLM needed: the store only moves
bytes). Importable by reader processes too: they regenerate the same tensors from a seed."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kvfuse import kvblob

# The default model (SmolLM2-135M): 30 layers, 3 KV heads, head_dim 64.
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64
FINGERPRINT = "test-model-fingerprint"


def make_kv(seed: int, tokens: int = 16) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Deterministic fp32 K/V and token ids for `seed` (a reader process regenerates the same)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(LAYERS, KV_HEADS, tokens, HEAD_DIM, generator=g)
    v = torch.randn(LAYERS, KV_HEADS, tokens, HEAD_DIM, generator=g)
    ids = torch.randint(0, 49152, (tokens,), generator=g).tolist()
    return k, v, ids


def make_blob(seed: int, tokens: int = 16, dtype: str = "float16", fingerprint: str = FINGERPRINT):
    """(key, blob, k, v, ids)."""
    k, v, ids = make_kv(seed, tokens)
    key = kvblob.chunk_key(fingerprint, dtype, ids)
    return key, kvblob.encode(k, v, model_fingerprint=fingerprint, token_ids=ids, dtype=dtype), k, v, ids


def make_readonly(path: Path) -> None:
    """Without root: take write permission away (with root the bind mount is already read-only)."""
    if os.geteuid() != 0:
        for p in [*path.rglob("*"), path]:
            p.chmod(0o555 if p.is_dir() else 0o444)
