"""KV where it pays: the device tier above the RAM tier (on the CPU its device is the host; on CUDA, GPU
memory), and a query's chunks read from LMDB on a thread pool, against reading them one by one."""

from __future__ import annotations

import threading

import pytest
import torch
from store_kvdata import make_blob

from kvfuse import kvblob
from kvfuse.blob_checksums import checksum, copy_payload
from kvfuse.store import CorruptBlobError, KVStore

CUDA = torch.cuda.is_available()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[pytest.mark.cuda,
                                                           pytest.mark.skipif(not CUDA, reason="no CUDA device")])])
def device(request) -> str:
    return request.param


@pytest.fixture
def open_store(settings_factory, device):
    """A store with the embedded index (the tiers do not touch the index: no Redis needed, on a GPU host too)."""
    opened = []

    def make(device_tier_mb: int = 64, read_threads: int = 4, hot_tier_mb: int = 64) -> KVStore:
        s = settings_factory(redis_url="", store={"device_tier_mb": device_tier_mb, "read_threads": read_threads,
                                                  "hot_tier_mb": hot_tier_mb})
        s = s.model_copy(update={"model": s.model.model_copy(update={"device": device})})
        opened.append(KVStore.open(s))
        return opened[-1]

    yield make
    for s in opened:
        s.close()


def test_a_read_fills_the_ram_and_device_tiers_and_the_next_one_stops_at_the_device(open_store, device) -> None:
    store = open_store()
    key, blob, k, v, _ = make_blob(21)
    store.put_chunk(key, blob)
    cold = store.load_chunk(key)  # from LMDB
    assert cold[0].device.type == "cpu" and store.hot.contains(key) and store.device_tier.contains(key)
    warm = store.load_chunk(key)
    assert warm[0].device.type == device and torch.equal(warm[0].cpu(), k.half()) and torch.equal(warm[1].cpu(), v.half())
    stats = store.stats()
    assert (stats["device_hits"], stats["device_misses"], stats["hot_hits"]) == (1, 1, 0)
    assert stats["device_bytes"] == k.half().nbytes * 2 and store.chunks.hits == {
        "device": 1, "hot": 0, "lmdb": 1, "miss": 0}
    store.put_chunk(key, blob)  # a put clears every cache's copy (already stored: nothing else changes)
    assert not store.device_tier.contains(key) and not store.hot.contains(key)


def test_the_device_tier_keeps_the_most_recent_chunks_within_its_budget(open_store) -> None:
    store = open_store(device_tier_mb=1)
    blobs = [make_blob(30 + i, tokens=14) for i in range(5)]  # fp16 K/V of 14 tokens: 322,560 bytes, 3 per MB
    for key, blob, *_ in blobs:
        store.put_chunk(key, blob)
        store.load_chunk(key)
    held = [key for key, *_ in blobs if store.device_tier.contains(key)]
    assert held == [key for key, *_ in blobs][-3:]
    assert store.stats()["device_bytes"] == 3 * 322_560 and store.stats()["device_evictions"] == 2


def test_reads_on_threads_equal_reads_one_by_one(open_store) -> None:
    store = open_store(device_tier_mb=0, hot_tier_mb=0, read_threads=4)
    made = [make_blob(40 + i, tokens=256, dtype="bfloat16") for i in range(8)]
    for key, blob, *_ in made:
        store.put_chunk(key, blob)
    bad_key, bad_blob, *_ = make_blob(60)
    store.put_chunk(bad_key, bad_blob)
    damaged = bytearray(bad_blob)
    damaged[len(damaged) // 2] ^= 0x10
    store.env.write(lambda txn: txn.put(bad_key.encode(), bytes(damaged), db=store.env.db("chunks")))
    keys = [key for key, *_ in made] + ["0" * 64, bad_key]
    got = store.load_chunks(keys)
    assert got[-2] is None and isinstance(got[-1], CorruptBlobError)
    for (key, _, k, v, _), entry in zip(made, got, strict=False):
        assert torch.equal(entry[0], k.bfloat16()) and torch.equal(entry[1], v.bfloat16())
        assert entry[2].key == key
    assert store.chunks.hits["lmdb"] == 8 and store.chunks.hits["miss"] == 1


def test_checked_copies_on_threads_are_each_exact() -> None:
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=gen).numpy().tobytes() for _ in range(4)]
    out: dict[int, bytearray] = {}

    def copy(i: int) -> None:
        out[i] = copy_payload(memoryview(sources[i]), checksum(sources[i]))

    threads = [threading.Thread(target=copy, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(bytes(out[i]) == sources[i] for i in range(4))
    with pytest.raises(kvblob.CorruptBlobError):
        copy_payload(memoryview(sources[0]), checksum(sources[1]))
