"""What names a chunk's KV cache: the content key and the hashes it is made of, and the KV dtypes at rest.

Identical chunk + context + model + dtype (+ key version) give the same key, so a cache is stored once;
any difference gives another key, so a stale or foreign cache is a miss, never a hit. The blob format
that stores the KV under that key is `kvfuse.kvblob`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

FORMAT_NAME = "kvfuse-kv"
KEY_VERSION = 1  # part of the content key; the KV a key names did not change with blob format version 2

# dtype name -> (torch dtype, safetensors dtype code)
DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "float16": (torch.float16, "F16"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "float32": (torch.float32, "F32"),
}

def dtype_size(dtype: str) -> int:
    return torch.empty((), dtype=torch_dtype(dtype)).element_size()


def torch_dtype(dtype: str) -> torch.dtype:
    try:
        return DTYPES[dtype][0]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {dtype!r}; expected one of {sorted(DTYPES)}") from None


def token_hash(token_ids: Sequence[int]) -> str:
    """sha256 hex of the ids as int32 little-endian."""
    return hashlib.sha256(torch.as_tensor(list(token_ids), dtype=torch.int32).numpy().tobytes()).hexdigest()


def chunk_key_from_hash(model_fingerprint: str, kv_dtype: str, token_hash_hex: str, context_hash: str = "") -> str:
    """Content key from an already computed token hash (what a stored header carries)."""
    torch_dtype(kv_dtype)
    text = f"{FORMAT_NAME}/{KEY_VERSION}\n{model_fingerprint}\n{kv_dtype}\n{token_hash_hex}"
    if context_hash:  # a chunk computed after a context is another cache; alone, the key is unchanged
        text += f"\ncontext\n{context_hash}"
    return hashlib.sha256(text.encode()).hexdigest()


def context_hash(context_ids: Sequence[int]) -> str:
    """The identity of a precompute context ("" for none)."""
    return token_hash(context_ids) if len(context_ids) else ""


def chunk_key(model_fingerprint: str, kv_dtype: str, token_ids: Sequence[int], context_ids: Sequence[int] = ()) -> str:
    """Identical chunk + context + model + dtype (+ format version) -> the same key, so it is stored
    once; any difference -> a different key, so a stale or foreign cache is a miss, never a hit."""
    return chunk_key_from_hash(model_fingerprint, kv_dtype, token_hash(token_ids), context_hash(context_ids))
