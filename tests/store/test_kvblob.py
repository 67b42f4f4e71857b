"""The blob format: round trips, zero-copy decode, corruption detection, content keys."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load
from store_kvdata import FINGERPRINT, HEAD_DIM, KV_HEADS, LAYERS, make_blob, make_kv

from kvfuse import kvblob


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_round_trip_is_bitwise_in_the_dtype_at_rest(dtype: str) -> None:
    key, blob, k, v, ids = make_blob(1, tokens=24, dtype=dtype)
    k2, v2, h = kvblob.decode(blob)
    tdt = kvblob.DTYPES[dtype][0]
    assert k2.dtype == v2.dtype == tdt and k2.shape == (LAYERS, KV_HEADS, 24, HEAD_DIM)
    # bitwise: compare the raw bits of the at-rest values
    bits = torch.int32 if dtype == "float32" else torch.int16
    assert torch.equal(k2.view(bits), k.to(tdt).view(bits))
    assert torch.equal(v2.view(bits), v.to(tdt).view(bits))
    assert h == kvblob.read_header(blob)
    assert (h.dtype, h.model_fingerprint, h.num_tokens, h.position) == (dtype, FINGERPRINT, 24, "rope0")
    assert h.token_hash == kvblob.token_hash(ids) and h.key == key
    assert len(blob) - h.payload_bytes < 1024  # the container adds a small header only
    # a standard safetensors reader opens it
    std = st_load(blob)
    assert torch.equal(std["k"].view(bits), k2.view(bits)) and torch.equal(std["v"].view(bits), v2.view(bits))
    assert kvblob.pack(k2, v2, h) == blob  # a tier packing what another decoded writes the same bytes


def test_decode_is_zero_copy_over_the_buffer() -> None:
    _, blob, *_ = make_blob(2)
    start = np.frombuffer(blob, dtype=np.uint8).ctypes.data
    k, v, h = kvblob.decode(memoryview(blob))
    for t in (k, v):
        assert start <= t.data_ptr() and t.data_ptr() + t.nbytes <= start + len(blob)
    assert v.data_ptr() - k.data_ptr() == h.payload_bytes // 2


def test_decode_with_copy_owns_its_memory() -> None:
    _, blob, k, v, _ = make_blob(7, dtype="bfloat16")
    start = np.frombuffer(blob, dtype=np.uint8).ctypes.data
    k2, v2, _ = kvblob.decode(blob, copy=True)
    assert not (start <= k2.data_ptr() < start + len(blob))
    assert torch.equal(k2, k.bfloat16()) and torch.equal(v2, v.bfloat16())
    k2.zero_()  # writable, and the blob is untouched
    assert torch.equal(kvblob.decode(blob)[0], k.bfloat16())


def test_a_flipped_byte_is_detected() -> None:
    _, blob, *_ = make_blob(3)
    bad = bytearray(blob)
    bad[-100] ^= 0x01  # one bit inside v's payload
    for copy in (False, True):
        with pytest.raises(kvblob.CorruptBlobError, match="checksum"):
            kvblob.decode(bytes(bad), copy=copy)
    kvblob.decode(bytes(bad), verify=False)  # the structure is intact; only the checksum can tell


@pytest.mark.parametrize(
    "mangle",
    [lambda b: b[:5], lambda b: b[:-2], lambda b: b"\xff" * 8 + b[8:], lambda b: b[:8] + b"[" + b[9:]],
    ids=["too-short", "truncated", "header-length", "header-json"],
)
def test_malformed_blobs_raise_corrupt(mangle) -> None:
    _, blob, *_ = make_blob(4)
    with pytest.raises(kvblob.CorruptBlobError):
        kvblob.decode(mangle(blob))


def test_keys_separate_model_dtype_and_tokens() -> None:
    _, _, ids = make_kv(5)
    base = kvblob.chunk_key("model-a", "float16", ids)
    assert base == kvblob.chunk_key("model-a", "float16", list(ids))
    assert base != kvblob.chunk_key("model-b", "float16", ids)
    assert base != kvblob.chunk_key("model-a", "bfloat16", ids)
    assert base != kvblob.chunk_key("model-a", "float16", ids[:-1])
    # every KV format names its own entry: the same chunk in two formats is two keys
    keys = {kvblob.chunk_key("model-a", fmt, ids) for fmt in kvblob.FORMATS}
    assert len(keys) == len(kvblob.FORMATS) == 6 and base in keys
    with pytest.raises(ValueError, match="unsupported KV format"):
        kvblob.chunk_key("model-a", "int2", ids)


def test_encode_rejects_mismatched_inputs() -> None:
    k, v, ids = make_kv(6)
    with pytest.raises(ValueError):
        kvblob.encode(k, v, model_fingerprint="m", token_ids=ids[:-1], dtype="float16")
    with pytest.raises(ValueError):
        kvblob.encode(k, v[:, :, :-1], model_fingerprint="m", token_ids=ids, dtype="float16")
