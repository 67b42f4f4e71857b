"""Reload or recompute with a real slow tier: the shared Redis tier reached through a TCP proxy that moves
128 KB/s (throttle_proxy.py, a real process between the worker's store and a real Redis), against the same
Redis reached directly. The link is that slow so the verdict holds on a loaded 2-core host, where the
model computes 20 to 500 tokens a second: reading the 256-token chunk takes 45 s behind it. The worker's ChunkCache measures both at start (a probe read through each, a
timed precompute of the real default model), and a query's chunk held only in the shared tier is
recomputed from its tokens behind the slow link (the KV a read of it gives) and read over the fast one; the
plan's counts say why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
import torch
from redis_server import free_port

from kvfuse import kvblob
from kvfuse.store import KVStore
from kvfuse.store.shared_tier import RedisTier

pytestmark = pytest.mark.slow

LINK_BYTES_PER_S = 128 << 10


@pytest.fixture
def slow_redis_url(redis_url: str):
    """The test Redis behind a 128 KB/s proxy."""
    parts = urlsplit(redis_url)
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("throttle_proxy.py")), str(port),
                             parts.hostname, str(parts.port or 6379), str(LINK_BYTES_PER_S)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        netloc = parts.netloc.rsplit(":", 1)[0] if parts.port else parts.netloc
        yield urlunsplit(parts._replace(netloc=f"{netloc.rsplit('@', 1)[0] + '@' if '@' in netloc else ''}127.0.0.1:{port}"))
    finally:
        proc.kill()
        proc.wait(10)


def test_a_chunk_behind_a_slow_link_is_recomputed_and_over_a_fast_one_read(
        slow_redis_url: str, redis_url: str, redis_namespace: str, settings_factory, default_llm_path: str,
        essays) -> None:
    from kvfuse.fusion import FusionEngine
    from kvfuse.service.worker.chunk_kv import ChunkCache

    engine = FusionEngine.load(default_llm_path, dtype="float32")
    ids = engine.tokenize(dict(essays)["apple"])[:256]
    want = engine.precompute([ids])[0]
    key = kvblob.chunk_key(engine.fingerprint, "float16", ids)
    prefix = f"{redis_namespace}:kv"
    direct = RedisTier(redis_url, prefix, 1 << 30)
    assert direct.put(key, kvblob.decode(kvblob.encode(want.k, want.v, model_fingerprint=engine.fingerprint,
                                                       token_ids=ids, dtype="float16")))
    settings = settings_factory(redis_url="", store={"kv_dtype": "float16", "hot_tier_mb": 0})
    seen = {}
    for link, url in (("slow", slow_redis_url), ("fast", redis_url)):
        shared = RedisTier(url, prefix, 1 << 30, timeout_s=60)
        with KVStore.open(settings, shared=shared) as store:  # its LMDB is empty: the chunk is only shared
            cache = ChunkCache(engine, store, settings)
            rates = cache.rates.snapshot()
            assert rates["read_bps_shared"] and rates["precompute_tokens_per_s"], rates
            [(ckv, rebuilt)] = cache.load_all([(key, ids)])
            seen[link] = (rates, cache.last_reads, rebuilt, shared.counters["hits"], ckv)
    rates, reads, rebuilt, hits, ckv = seen["slow"]
    assert rates["read_bps_shared"] < 1.5 * LINK_BYTES_PER_S  # the probe saw the link's rate
    assert reads.get("source:recompute:read_slower") == 1 and rebuilt and hits == 0, (reads, rates)
    assert torch.equal(ckv.k, want.k.half())  # computed from its tokens, as stored: what a read gives
    rates, reads, rebuilt, hits, ckv = seen["fast"]
    assert reads.get("source:read:read_faster") == 1 and reads.get("shared") == 1 and not rebuilt and hits == 1, reads
    assert torch.equal(ckv.k, want.k.half())  # read: the float16 it was stored in
