"""What names a chunk's KV cache: the content key and the hashes it is made of, and the KV formats at rest.

Identical chunk + context + model + dtype (+ key version) give the same key, so a cache is stored once;
any difference gives another key, so a stale or foreign cache is a miss, never a hit. The blob format
that stores the KV under that key is `kvfuse.kvblob`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

FORMAT_NAME = "kvfuse-kv"
KEY_VERSION = 1  # part of the content key; the KV a key names did not change with blob format version 2

# float format name (also torch's dtype name) -> safetensors dtype code; torch-free, so the CLI's parser
# and the health probes can name the formats without loading torch (kvfuse.kv_formats.DTYPES adds the dtypes)
FLOAT_CODES: dict[str, str] = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}
# quantized formats: codes plus scales (kvfuse/kv_formats.py says what each stores)
QUANTIZED_FORMATS = ("fp8", "int8", "int4")
FORMATS = (*FLOAT_CODES, *QUANTIZED_FORMATS)  # every KV format at rest (store.kv_dtype)


def check_format(kv_dtype: str) -> str:
    if kv_dtype not in FORMATS:
        raise ValueError(f"unsupported KV format {kv_dtype!r}; expected one of {', '.join(FORMATS)}")
    return kv_dtype


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a float format (a quantized one has several tensors: kvfuse.kv_formats)."""
    if dtype not in FLOAT_CODES:
        raise ValueError(f"{dtype!r} is not a float KV format; expected one of {sorted(FLOAT_CODES)}")
    import torch

    dt: torch.dtype = getattr(torch, dtype)
    return dt


def token_hash(token_ids: Sequence[int]) -> str:
    """sha256 hex of the ids as int32 little-endian."""
    return hashlib.sha256(np.asarray(list(token_ids), dtype="<i4").tobytes()).hexdigest()


def chunk_key_from_hash(model_fingerprint: str, kv_dtype: str, token_hash_hex: str, context_hash: str = "") -> str:
    """Content key from an already computed token hash (what a stored header carries). The format is part
    of it: the same chunk in two formats is two entries, so a store may hold several formats at once."""
    check_format(kv_dtype)
    text = f"{FORMAT_NAME}/{KEY_VERSION}\n{model_fingerprint}\n{kv_dtype}\n{token_hash_hex}"
    if context_hash:  # a chunk computed after a context is another cache; alone, the key is unchanged
        text += f"\ncontext\n{context_hash}"
    return hashlib.sha256(text.encode()).hexdigest()


def context_hash(context_ids: Sequence[int]) -> str:
    """The identity of a precompute context ("" for none)."""
    return token_hash(context_ids) if len(context_ids) else ""


def chunk_key(model_fingerprint: str, kv_dtype: str, token_ids: Sequence[int], context_ids: Sequence[int] = ()) -> str:
    """Identical chunk + context + model + KV format (+ key version) -> the same key, so it is stored
    once; any difference -> a different key, so a stale or foreign cache is a miss, never a hit."""
    return chunk_key_from_hash(model_fingerprint, kv_dtype, token_hash(token_ids), context_hash(context_ids))
