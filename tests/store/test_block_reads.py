"""Blob version 2: block reads that copy only the asked blocks (checked by their own checksums), artifacts
kept with the chunk through every tier, and version-1 blobs that still load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load
from store_kvdata import FINGERPRINT, make_kv

from kvfuse import blob_checksums, kvblob
from kvfuse.store.chunk_store import TieredStore
from kvfuse.store.hot_tier import HotTier
from kvfuse.store.lmdb_env import LmdbEnv
from kvfuse.store.lmdb_tier import LmdbTier

TOKENS = 200  # 4 blocks of 64: the last one short (8 tokens)


def _arts() -> dict[str, torch.Tensor]:
    return {"x.keys": torch.randn(3, 4, 5), "x.ids": torch.arange(7), "x.half": torch.randn(3).half(),
            "x.none": torch.empty(0, dtype=torch.long)}


def _v1_blob(k: torch.Tensor, v: torch.Tensor, ids: list[int]) -> bytes:
    """A version-1 blob, byte for byte what version 1 wrote: `pack` of a version-1 header writes that
    layout (k, v, no block checksums, no artifacts)."""
    k16, v16 = k.half().contiguous(), v.half().contiguous()
    header = kvblob.KVHeader(1, FINGERPRINT, "float16", *k.shape[:2], k.shape[3], k.shape[2], kvblob.token_hash(ids),
                             "rope0", blob_checksums.checksum(blob_checksums.bytes_view(k16), blob_checksums.bytes_view(v16)))
    return kvblob.pack(k16, v16, header)


@pytest.fixture
def env(tmp_path: Path):
    e = LmdbEnv(tmp_path / "db", map_size=1 << 27, max_readers=8)
    yield e
    e.close()


def test_version2_round_trip_with_artifacts_and_standard_reader() -> None:
    k, v, ids = make_kv(1, TOKENS)
    arts = _arts()
    blob = kvblob.encode(k, v, model_fingerprint=FINGERPRINT, token_ids=ids, dtype="float16", artifacts=arts)
    k2, v2, h = kvblob.decode(blob, copy=True)
    assert h.format_version == 2 and h.block_tokens == 64 and len(h.block_checksums) == 4
    assert torch.equal(k2, k.half()) and torch.equal(v2, v.half())
    assert set(h.artifacts) == set(arts) and all(torch.equal(h.artifacts[n], arts[n]) for n in arts)
    assert kvblob.pack(k2, v2, h) == blob  # a tier re-packing what it decoded keeps the artifacts
    std = st_load(blob)  # still a standard safetensors file
    assert torch.equal(std["a.x.ids"], arts["x.ids"])
    header, got = kvblob.read_artifacts(blob)
    assert torch.equal(got["x.keys"], arts["x.keys"]) and header.key == kvblob.chunk_key(FINGERPRINT, "float16", ids)


def test_read_blocks_copies_only_those_blocks_and_checks_them() -> None:
    k, v, ids = make_kv(2, TOKENS)
    blob = kvblob.encode(k, v, model_fingerprint=FINGERPRINT, token_ids=ids, dtype="float16")
    bk, bv, _ = kvblob.read_blocks(blob, [1, 3])
    idx = torch.tensor(list(range(64, 128)) + list(range(192, 200)))
    assert torch.equal(bk, k.half()[:, :, idx]) and torch.equal(bv, v.half()[:, :, idx])
    # a flipped byte in block 2 is caught by a read of block 2, not by reads of other blocks
    h = kvblob.read_header(blob)
    start = len(blob) - h.payload_bytes
    bad = bytearray(blob)
    bad[start + 130 * 64 * 2] ^= 1  # layer 0, head 0, token 130, in block 2 of k
    kvblob.read_blocks(bytes(bad), [0, 1, 3])
    with pytest.raises(kvblob.CorruptBlobError, match="checksum"):
        kvblob.read_blocks(bytes(bad), [2])


def test_version1_blobs_still_load() -> None:
    k, v, ids = make_kv(3, TOKENS)
    blob = _v1_blob(k, v, ids)
    k2, v2, h = kvblob.decode(blob)
    assert h.format_version == 1 and h.artifacts is None and not h.block_checksums
    assert torch.equal(k2, k.half()) and torch.equal(v2, v.half())
    assert h.key == kvblob.chunk_key(FINGERPRINT, "float16", ids)  # same key as a version-2 blob of it
    assert kvblob.read_artifacts(blob)[1] is None
    assert kvblob.pack(k2, v2, h) == blob
    with pytest.raises(kvblob.CorruptBlobError, match="no blocks"):
        kvblob.read_blocks(blob, [0])


def test_store_tiers_read_blocks(env) -> None:
    lmdb = LmdbTier(env)
    hot = HotTier(1 << 26)
    tiers = TieredStore(hot, lmdb)
    k, v, ids = make_kv(4, TOKENS)
    arts = _arts()
    blob = kvblob.encode(k, v, model_fingerprint=FINGERPRINT, token_ids=ids, dtype="float16", artifacts=arts)
    key = kvblob.chunk_key(FINGERPRINT, "float16", ids)
    assert tiers.put(key, kvblob.decode(blob))
    (bk, _, _), nbytes = tiers.get_blocks(key, [0, 2])
    assert torch.equal(bk, k.half()[:, :, list(range(64)) + list(range(128, 192))])
    assert nbytes == bk.nbytes * 2  # only the two blocks were read from LMDB
    assert not hot.contains(key)  # a partial read is not written back up
    header = tiers.get_artifacts(key)
    assert torch.equal(header.artifacts["x.keys"], arts["x.keys"])
    tiers.get(key)  # a full read fills the hot tier; blocks then come from RAM, reading nothing
    (bk2, _, _), nbytes2 = tiers.get_blocks(key, [0, 2])
    assert torch.equal(bk2, bk) and nbytes2 == 0
    # a version-1 blob in LMDB: read whole and sliced, counted whole
    k1, v1, ids1 = make_kv(5, TOKENS)
    key1 = kvblob.chunk_key(FINGERPRINT, "float16", ids1)
    assert lmdb.put(key1, kvblob.decode(_v1_blob(k1, v1, ids1)))
    (bk1, _, h1), n1 = lmdb.get_blocks(key1, [3])
    assert torch.equal(bk1, k1.half()[:, :, 192:]) and n1 == h1.payload_bytes
    assert lmdb.get_artifacts(key1).artifacts is None
