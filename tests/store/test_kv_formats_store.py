"""Quantized KV formats in the blob and the store: a blob names its format and reads back what was stored
(codes and scales, checksummed, block by block too), keys keep formats apart, and one store holds a
chunk in two formats at once, each tier handing out its own."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as st_load
from store_kvdata import FINGERPRINT, HEAD_DIM, KV_HEADS, LAYERS, make_kv

from kvfuse import kv_formats, kvblob
from kvfuse.store import KVStore

QUANTIZED = list(kv_formats.QUANTIZED)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_a_quantized_blob_names_its_format_and_reads_back_its_codes(fmt: str) -> None:
    k, v, ids = make_kv(11, tokens=150)
    blob = kvblob.encode(k, v, model_fingerprint=FINGERPRINT, token_ids=ids, dtype=fmt,
                         artifacts={"x": torch.arange(3)})
    k2, v2, h = kvblob.decode(blob)
    assert h.dtype == fmt and h.quantized and h.key == kvblob.chunk_key(FINGERPRINT, fmt, ids)
    assert isinstance(k2, kv_formats.QTensor) and k2.shape == (LAYERS, KV_HEADS, 150, HEAD_DIM)
    # what was stored is what a direct quantization gives, bit for bit
    assert torch.equal(k2.dequantize(), kv_formats.quantize(k, fmt, 0).dequantize())
    assert torch.equal(v2.dequantize(), kv_formats.quantize(v, fmt, 1).dequantize())
    assert h.payload_bytes == kv_formats.payload_bytes(fmt, h.shape)
    assert kvblob.pack(k2, v2, h) == blob  # a tier packing what another decoded writes the same bytes
    std = st_load(blob)  # a standard safetensors reader opens it: codes, then scales
    assert torch.equal(std["k"], k2.data) and torch.equal(std["v.scale"], v2.scale)
    kc, vc, hc = kvblob.decode(blob, copy=True)
    assert torch.equal(kc.dequantize(), k2.dequantize()) and torch.equal(hc.artifacts["x"], torch.arange(3))


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_a_flipped_bit_in_codes_or_scales_is_caught_whole_and_by_block(fmt: str) -> None:
    k, v, ids = make_kv(12, tokens=150)
    blob = kvblob.encode(k, v, model_fingerprint=FINGERPRINT, token_ids=ids, dtype=fmt)
    h = kvblob.read_header(blob)
    start = len(blob) - h.payload_bytes
    scale_at = start + 2 * k.numel() // (2 if fmt == "int4" else 1) + 3  # inside k.scale
    for at in (start + 5, scale_at):
        bad = bytearray(blob)
        bad[at] ^= 0x01
        with pytest.raises(kvblob.CorruptBlobError, match="checksum"):
            kvblob.decode(bytes(bad))
        with pytest.raises(kvblob.CorruptBlobError, match="checksum"):
            kvblob.read_blocks(bytes(bad), [0])  # both flips are in block 0 (tokens 0..63) of layer 0
        kvblob.read_blocks(bytes(bad), [2], verify=True)  # another block's bytes are intact


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_block_reads_of_a_quantized_blob_are_those_tokens(fmt: str) -> None:
    k, v, ids = make_kv(13, tokens=150)
    blob = kvblob.encode(k, v, model_fingerprint=FINGERPRINT, token_ids=ids, dtype=fmt)
    kw, vw, _ = kvblob.decode(blob)
    kb, vb, _ = kvblob.read_blocks(blob, [0, 2])
    keep = torch.cat([torch.arange(0, 64), torch.arange(128, 150)])
    assert torch.equal(kb.dequantize(), kw.dequantize().index_select(2, keep))
    assert torch.equal(vb.dequantize(), vw.dequantize().index_select(2, keep))


def test_one_store_holds_a_chunk_in_two_formats(store_settings, tmp_path) -> None:
    k, v, ids = make_kv(14, tokens=80)
    with KVStore.open(store_settings(data_dir=tmp_path)) as store:
        k16, _ = store.put_kv(FINGERPRINT, "float16", ids, k, v)
        k4, n4 = store.put_kv(FINGERPRINT, "int4", ids, k, v)
        assert k16 != k4 and store.has_chunk(k16) and store.has_chunk(k4)
        stats = store.stats()
        assert stats["chunks"] == 2 and n4 < 0.32 * (stats["kv_bytes"] - n4)  # int4 under a third of float16
        for key, fmt in ((k16, "float16"), (k4, "int4")):
            for _ in range(2):  # from LMDB, then from the hot tier
                got_k, got_v, header = store.load_chunk(key)
                assert header.dtype == fmt
                assert isinstance(got_k, kv_formats.QTensor) == (fmt == "int4")
                want = kv_formats.round_trip(k, fmt, 0)
                assert torch.equal(kv_formats.dequantize(got_k, torch.float32), want)
            (bk, _, _), nbytes = store.load_blocks(key, [1])  # from the hot tier: sliced, nothing read
            assert kv_formats.dequantize(bk, torch.float32).shape == (LAYERS, KV_HEADS, 16, HEAD_DIM)
        store.hot.clear()
        (bk, bv, _), nbytes = store.load_blocks(k4, [1])  # from LMDB: that block's codes and scales only
        assert 0 < nbytes < kv_formats.payload_bytes("int4", (LAYERS, KV_HEADS, 80, HEAD_DIM)) / 3
