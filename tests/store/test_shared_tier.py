"""The shared chunk KV tier in Redis (kvfuse.store.shared_tier): content-addressed entries any host can
read, metadata written last, a byte cap kept by S3-FIFO in a server-side script, and its place under a fleet worker's LMDB."""

from __future__ import annotations

import random

import redis
import torch
from redis_server import free_port, start_redis
from store_kvdata import make_blob

from kvfuse import kvblob
from kvfuse.store import KVStore
from kvfuse.store.eviction_policy import S3FIFO
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
    assert tier.put(key, kvblob.decode(blob)) and tier.get(key).header.key == key


def test_when_full_the_tier_evicts_by_s3fifo_as_the_policy_does(redis_url, redis_namespace) -> None:
    """One sequence of puts and reads through the tier's script and through store/eviction_policy.S3FIFO
    at the same cap: after every step both hold the same chunks (the script is the policy, atomic)."""
    blobs = [make_blob(10 + i, tokens=4)[:2] for i in range(24)]
    size = len(blobs[0][1])
    assert all(len(b) == size for _, b in blobs)
    cap = 8 * size
    tier, ref = _tier(redis_url, redis_namespace, cap=cap), S3FIFO(cap)
    rng = random.Random(0)
    for step in range(160):
        key, blob = blobs[min(int(rng.paretovariate(1.0)) - 1, 23) if step % 3 else rng.randrange(24)]
        if key in ref:
            ref.access(key)
            assert tier.get(key).header.key == key
        else:
            ref.victims(ref.bytes + size - cap)
            ref.insert(key, size)
            assert tier.put(key, kvblob.decode(blob))
        held = {k for k, _ in blobs if tier.contains(k)}
        assert held == set(ref.sizes), step
        assert tier.used_bytes() == ref.bytes <= cap
    assert tier.evictions() == tier.counters["evictions"] > 0 and tier.counters["full"] == 0
    # a removed chunk leaves its queue too: the next evictions still match
    gone = next(iter(ref.sizes))
    assert tier.remove(gone) and ref.remove(gone)
    for key, blob in blobs[:6]:
        if key not in ref:
            ref.victims(ref.bytes + size - cap)
            ref.insert(key, size)
            tier.put(key, kvblob.decode(blob))
    assert {k for k, _ in blobs if tier.contains(k)} == set(ref.sizes)


def test_a_chunk_larger_than_the_cap_is_refused(redis_url, redis_namespace) -> None:
    key1, blob1, *_ = make_blob(3)
    key2, blob2, *_ = make_blob(4, tokens=64)
    tier = _tier(redis_url, redis_namespace, cap=len(blob1) * 2)
    assert tier.put(key1, kvblob.decode(blob1))
    assert not tier.put(key2, kvblob.decode(blob2))  # alone over the cap: refused, nothing evicted
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
        assert b.load_chunk(key).header.key == key
        assert b.chunks.hits["shared"] == 1 and b.has_chunk(key)  # written back into B's LMDB
        b.hot.clear()
        assert b.load_chunk(key) is not None and b.chunks.hits["lmdb"] == 1


def test_redis_at_maxmemory_refuses_and_nothing_else_is_evicted(tmp_path) -> None:
    """Redis stays noeviction (it holds the index and the job streams too): a put it refuses is counted
    full, and what the tier held stays readable."""
    port = free_port()
    proc = start_redis(port, tmp_path, "--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
    try:
        url = f"redis://127.0.0.1:{port}/0"
        tier = RedisTier(url, "t:kv", 1 << 30)  # its own cap far above Redis's
        stored, refused = [], 0
        for seed in range(12):
            key, blob, *_ = make_blob(seed, tokens=8)  # 180 kB each
            if tier.put(key, kvblob.decode(blob)):
                stored.append(key)
            else:
                refused += 1
        assert stored and refused and tier.counters["full"] == refused and tier.counters["evictions"] == 0
        assert all(tier.get(k).header.key == k for k in stored)
    finally:
        proc.terminate()
        proc.wait(10)
