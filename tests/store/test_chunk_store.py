"""Chunk KV tiers composed read-through: a RAM hot tier over real LMDB blob tiers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from store_kvdata import FINGERPRINT, make_blob, make_kv

from kvfuse import kvblob
from kvfuse.store import CorruptBlobError, KVStore
from kvfuse.store.chunk_store import TieredStore
from kvfuse.store.hot_tier import HotTier
from kvfuse.store.lmdb_env import LmdbEnv
from kvfuse.store.lmdb_tier import LmdbTier


@pytest.fixture
def envs(tmp_path: Path):
    opened = []

    def make(name: str) -> LmdbEnv:
        env = LmdbEnv(tmp_path / name, map_size=1 << 26, max_readers=8)
        opened.append(env)
        return env

    yield make
    for env in opened:
        env.close()


def _entry(seed: int):
    key, blob, *_ = make_blob(seed)
    return key, kvblob.decode(blob)


def test_a_hit_in_lmdb_is_written_back_to_the_hot_tier(envs) -> None:
    hot, lmdb = HotTier(1 << 24), LmdbTier(envs("a"))
    tiers = TieredStore(hot, lmdb)
    key, entry = _entry(1)
    assert tiers.put(key, entry) and lmdb.contains(key) and not hot.contains(key)  # puts skip the cache
    first = tiers.get(key)
    assert isinstance(first, kvblob.ChunkEntry) and torch.equal(first.k, entry.k) and hot.contains(key)
    assert tiers.get(key).k is first.k  # now served by the hot tier, the same tensors
    assert (hot.stats()["hot_hits"], hot.stats()["hot_misses"]) == (1, 1)
    assert tiers.get("0" * 64) is None


def test_a_hit_deeper_down_is_written_back_to_every_tier_above(envs) -> None:
    hot, near, far = HotTier(1 << 24), LmdbTier(envs("near")), LmdbTier(envs("far"))  # far: a shared tier
    key, entry = _entry(2)
    assert far.put(key, entry)
    tiers = TieredStore(hot, near, far)
    assert tiers.contains(key) and not near.contains(key)
    got = tiers.get(key)
    assert torch.equal(got[1], entry[1]) and near.contains(key) and hot.contains(key)
    with near.env.read() as txn:  # the copy written back is the same blob, byte for byte
        assert bytes(txn.get(key.encode(), db=near.env.db("chunks"))) == kvblob.pack(*entry)


def test_contains_and_remove_cover_every_tier(envs) -> None:
    hot, near, far = HotTier(1 << 24), LmdbTier(envs("near")), LmdbTier(envs("far"))
    tiers = TieredStore(hot, near, far)
    key, entry = _entry(3)
    only_hot, hot_entry = _entry(4)
    hot.put(only_hot, hot_entry)
    assert tiers.contains(only_hot)
    assert tiers.put(key, entry) and near.contains(key) and far.contains(key)  # puts reach every store
    tiers.get(key)
    assert all(t.contains(key) for t in (hot, near, far))
    assert tiers.remove(key) and not any(t.contains(key) for t in (hot, near, far))
    assert not tiers.contains(key) and tiers.get(key) is None
    assert not tiers.remove(key)
    assert tiers.remove(only_hot) and not tiers.contains(only_hot)


def test_a_put_replaces_the_cached_copy_and_a_corrupt_blob_is_an_error(envs) -> None:
    env = envs("a")
    hot, lmdb = HotTier(1 << 24), LmdbTier(env)
    tiers = TieredStore(hot, lmdb)
    key, entry = _entry(5)
    tiers.put(key, entry)
    tiers.get(key)
    bad = bytearray(kvblob.pack(*entry))
    bad[-1] ^= 0xFF
    env.write(lambda txn: txn.put(key.encode(), bytes(bad), db=env.db("chunks")))
    assert tiers.get(key) is not None  # the hot copy (decoded before the damage) still serves
    tiers.evict([key])
    with pytest.raises(CorruptBlobError):
        tiers.get(key)
    assert not hot.contains(key)
    assert tiers.put(key, entry) and torch.equal(tiers.get(key).k, entry.k)  # the corrupt blob is replaced


def test_put_kv_encodes_keys_and_stores_a_chunk(settings_factory) -> None:
    k, v, ids = make_kv(6)
    with KVStore.open(settings_factory(redis_url="")) as store:
        key, nbytes = store.put_kv(FINGERPRINT, "bfloat16", ids, k, v)
        assert key == kvblob.chunk_key(FINGERPRINT, "bfloat16", ids) and store.has_chunk(key)
        assert store.stats()["kv_bytes"] == nbytes
        assert store.put_kv(FINGERPRINT, "bfloat16", ids, k, v) == (key, nbytes)  # stored once
        k2, v2, header = store.load_chunk(key)
        assert torch.equal(k2, k.to(torch.bfloat16)) and header.token_hash == kvblob.token_hash(ids)


def test_a_chunk_is_located_with_its_bytes_in_the_format_it_was_stored_in(envs) -> None:
    """The reload policy costs a read by the bytes the tier keeps for that chunk (ChunkStore.size): a store
    holds several KV formats at once, so an int4 chunk is a third of a float16 one's bytes whatever
    `store.kv_dtype` says now."""
    hot, lmdb = HotTier(1 << 24), LmdbTier(envs("formats"))
    tiers = TieredStore(hot, lmdb)
    sizes = {}
    for dtype in ("float16", "int4"):
        key, blob, *_ = make_blob(7, tokens=64, dtype=dtype)
        assert tiers.put(key, kvblob.decode(blob))
        assert tiers.locate(key) == ("lmdb", len(blob))
        sizes[dtype] = len(blob)
        entry = tiers.get(key)  # now in the hot tier too: located there, with its decoded bytes
        assert tiers.locate(key) == ("hot", entry[0].nbytes + entry[1].nbytes)
    assert sizes["int4"] < 0.4 * sizes["float16"]
    assert tiers.locate("0" * 64) == (None, None)
