"""The worker's chunk KV over an LMDB budget smaller than one document (store.lmdb_budget_mb): chunks the
budget evicted are rebuilt from their token ids when a query loads them, a chunk keyed alone is stored
again (the policy's readmission; one keyed after a context is not: what it is rebuilt with is not what its
key names), and the answer at ratio 1.0 over the rebuilt chunks equals vanilla's: the same logits, so the
same first token, on the real default model."""

from __future__ import annotations

import pytest
import torch

from kvfuse.store import KVStore
from kvfuse.store.records import DocumentRecord

pytestmark = pytest.mark.slow


def test_evicted_chunks_are_rebuilt_and_ratio_one_answers_equal_vanilla(settings_factory, default_llm_path,
                                                                           essays) -> None:
    from kvfuse.fusion import FusionEngine, FusionOptions
    from kvfuse.service.worker.chunk_kv import ChunkCache

    engine = FusionEngine.load(default_llm_path, dtype="float32")
    ids = engine.tokenize(dict(essays)["apple"])
    chunks = [ids[i * 40:(i + 1) * 40] for i in range(6)]  # 0.46 MB each at int8: the budget keeps two
    contexts = [[] for _ in chunks[:-1]] + [ids[160:200]]  # the last one computed after the one before it
    settings = settings_factory(redis_url="", store={"lmdb_budget_mb": 1, "hot_tier_mb": 0,
                                                     "reload_policy": False})
    with KVStore.open(settings) as store:
        cache = ChunkCache(engine, store, settings)
        keys = [cache.key_of(c, x) for c, x in zip(chunks, contexts, strict=True)]
        store.catalog.put_document(DocumentRecord(id="apple", status="processing", chunk_keys=keys), "text")
        assert [k for k, _ in cache.compute_and_store(chunks, contexts)] == keys
        store.set_status("apple", "ready")  # most of its chunks evicted already
        evicted = [k for k in keys if not store.has_chunk(k)]
        assert len(evicted) >= 3 and store.stats()["kv_bytes"] <= 1 << 20
        loaded = cache.load_all(list(zip(keys, chunks, strict=True)))
        assert [rebuilt for _, rebuilt in loaded] == [k in evicted for k in keys]
        readmitted = {k for k in evicted if store.has_chunk(k)}
        assert readmitted and keys[-1] not in readmitted  # the context-keyed one stays evicted
        assert store.stats()["kv_bytes"] <= 1 << 20

    prefix_ids, question_ids = engine.prompt_parts("What does the author think of the App Store?", "Answer briefly.")
    prefix = engine.precompute([prefix_ids])[0]
    fused_chunks = [ckv for ckv, _ in loaded]
    r1 = FusionOptions(method="a3", recompute_ratio=1.0, edge_tokens=10_000, edge_tokens_end=10_000)
    vanilla = FusionOptions(method="vanilla")
    fused = engine.fuse(prefix, fused_chunks, question_ids, r1)
    want = engine.fuse(prefix, fused_chunks, question_ids, vanilla)
    torch.testing.assert_close(fused.logits, want.logits, atol=2e-4, rtol=0)
    assert fused.logits.argmax() == want.logits.argmax()


def test_a_chunk_rebuilt_without_a_budget_is_kept_only_while_a_document_uses_it(settings_factory, default_llm_path,
                                                                                  essays) -> None:
    """ChunkCache.load_or_rebuild keeps every rebuild (no budget needed): a referenced chunk lost from LMDB
    comes back with the same KV as before, and one no document uses is computed but never stored."""
    from kvfuse.fusion import FusionEngine
    from kvfuse.service.worker.chunk_kv import ChunkCache
    from kvfuse.store.lmdb_tier import LmdbTier

    engine = FusionEngine.load(default_llm_path, dtype="float32")
    ids = engine.tokenize(dict(essays)["apple"])
    used, unused = ids[:40], ids[40:80]
    settings = settings_factory(redis_url="", store={"hot_tier_mb": 0, "reload_policy": False})
    with KVStore.open(settings) as store:
        cache = ChunkCache(engine, store, settings)
        key, stray = cache.key_of(used), cache.key_of(unused)
        store.catalog.put_document(DocumentRecord(id="apple", status="processing", chunk_keys=[key]), "text")
        cache.compute_and_store([used], [[]])
        store.set_status("apple", "ready")
        before, _ = cache.load_or_rebuild(key, used, context=[])
        LmdbTier.remove(store.blobs, key)  # lost from LMDB, not evicted by any budget
        assert not store.has_chunk(key)
        again, rebuilt = cache.load_or_rebuild(key, used, context=[])
        assert rebuilt and store.has_chunk(key)
        for a, b in ((again.k, before.k), (again.v, before.v)):  # stored int8: compare every part
            for x, y in zip(a.parts(), b.parts(), strict=True):
                torch.testing.assert_close(x, y)
        _, rebuilt = cache.load_or_rebuild(stray, unused, context=[])
        assert rebuilt and not store.has_chunk(stray)
