"""The shared chunk KV tier in Redis (kvfuse.store.shared_tier): content-addressed entries any host can
read, metadata written last, a byte cap with a stated policy, and its place under a fleet worker's LMDB."""

from __future__ import annotations

import redis
import torch
from store_kvdata import make_blob

from kvfuse import kvblob
from kvfuse.store import KVStore
from kvfuse.store.shared_tier import RedisTier


def _tier(redis_url: str, ns: str, cap: int = 1 << 30) -> RedisTier:
    return RedisTier(redis_url, f"{ns}:kv", cap)


def test_put_get_remove_and_the_byte_total(redis_url, redis_namespace) -> None:
    tier = _tier(redis_url, redis_namespace)
    key, blob, *_ = make_blob(1)
    entry = kvblob.decode(blob)
    assert not tier.contains(key) and tier.get(key) is None
    assert tier.put(key, entry) and not tier.put(key, entry)  # stored once
    assert tier.contains(key) and tier.used_bytes() == len(blob)
    k, v, header = tier.get(key)
    assert header.key == key and torch.equal(k, entry[0]) and torch.equal(v, entry[1])
    assert tier.remove(key) and not tier.contains(key) and tier.used_bytes() == 0 and not tier.remove(key)
    assert tier.counters["hits"] == 1 and tier.counters["misses"] == 1 and tier.counters["puts"] == 1


def test_a_blob_without_its_metadata_is_never_read(redis_url, redis_namespace) -> None:
    tier = _tier(redis_url, redis_namespace)
    key, blob, *_ = make_blob(2)
    # What a writer that died between the two keys would leave (the real put writes both in one script).
    redis.Redis.from_url(redis_url).set(f"{redis_namespace}:kv:blob:{key}", blob[: len(blob) // 2])
    assert not tier.contains(key) and tier.get(key) is None
    assert tier.put(key, kvblob.decode(blob)) and tier.get(key)[2].key == key


def test_when_full_new_chunks_are_refused_not_evicted(redis_url, redis_namespace) -> None:
    key1, blob1, *_ = make_blob(3)
    key2, blob2, *_ = make_blob(4)
    tier = _tier(redis_url, redis_namespace, cap=len(blob1) + len(blob2) // 2)
    assert tier.put(key1, kvblob.decode(blob1))
    assert not tier.put(key2, kvblob.decode(blob2))  # over the cap: refused
    assert tier.contains(key1) and not tier.contains(key2) and tier.counters["full"] == 1


def test_a_worker_store_reads_the_shared_tier_and_writes_the_hit_back(settings_factory, tmp_path, redis_url,
                                                                      redis_namespace) -> None:
    key, blob, *_ = make_blob(5)
    host_a = settings_factory(data_dir=tmp_path / "a")
    host_b = settings_factory(data_dir=tmp_path / "b")
    with KVStore.open(host_a, shared=_tier(redis_url, redis_namespace)) as a:
        a.put_chunk(key, blob)  # precompute: the host's LMDB and the shared tier
        assert a.has_chunk(key)
    with KVStore.open(host_b, shared=_tier(redis_url, redis_namespace)) as b:
        assert not b.has_chunk(key)
        assert b.load_chunk(key)[2].key == key
        assert b.chunks.hits["shared"] == 1 and b.has_chunk(key)  # written back into B's LMDB
        b.hot.clear()
        assert b.load_chunk(key) is not None and b.chunks.hits["lmdb"] == 1
