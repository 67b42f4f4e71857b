"""`store.lmdb_budget_mb`: the chunk KV of a host's LMDB stays within the budget, its file within the budget
plus the stated slack however much is ingested (docs/DESIGN.md, "Bounded tiers"); documents whose chunks
were evicted stay `ready` and are not lost to `kvfuse store check`; pinned chunks are never evicted; an
evicted chunk comes back only while a document uses it. Real LMDB, random KV of the default model's
shapes (tests/store/store_kvdata.py)."""

from __future__ import annotations

import os
import random

import pytest
from store_kvdata import make_blob

from kvfuse.store.check import check_store
from kvfuse.store.cli import _print_check
from kvfuse.store.kvstore import KVStore
from kvfuse.store.records import DocumentRecord

BUDGET_MB = 8


def _settings(settings_factory, budget_mb: int = BUDGET_MB, **store):
    return settings_factory(redis_url="", store={"lmdb_budget_mb": budget_mb, "hot_tier_mb": 0, **store})


MADE: dict[str, tuple[int, int]] = {}  # chunk key -> (seed, tokens) of make_blob


def _ingest(store: KVStore, rng: random.Random, doc: int, seed: int) -> tuple[list[str], int, int]:
    """One document of 1-4 chunks, three in four of them full-sized (48 tokens: 1.06 MB at float16), the
    rest shorter, as a document's last chunk is; staged like an ingest: record with refs, blobs, ready.
    Returns (its chunk keys, next seed, largest blob)."""
    blobs = []
    for _ in range(rng.randint(1, 4)):
        seed += 1
        tokens = 48 if rng.random() < 0.75 else rng.randint(8, 47)
        key, blob, *_ = make_blob(seed, tokens=tokens)
        MADE[key] = (seed, tokens)
        blobs.append((key, blob))
    keys = [k for k, _ in blobs]
    store.catalog.put_document(DocumentRecord(id=f"d{doc}", status="processing", chunk_keys=keys), "text")
    for key, blob in blobs:
        store.put_chunk(key, blob)
        assert store.stats()["kv_bytes"] <= BUDGET_MB << 20
    store.set_status(f"d{doc}", "ready")  # with some of its chunks evicted already, if need be
    return keys, seed, max(len(b) for _, b in blobs)


def _file_bytes(store: KVStore) -> int:
    return os.path.getsize(store.env.path / "data.mdb")


def test_lmdb_file_stays_within_budget_plus_slack(settings_factory, capsys) -> None:
    """Ten budgets of KV ingested (and every other document read back, so the policy sees reuse): the
    stored KV never passes the budget, the file stops growing after the first budgets' churn, and it
    stays within the budget plus the stated slack: three of the largest blobs (pages freed by a write
    transaction are reusable two transactions later) plus half the budget for free runs too short for
    a whole blob (the measured fragmentation of chunk-sized overflow pages is below that)."""
    rng = random.Random(0)
    budget = BUDGET_MB << 20
    seed, largest, ingested, doc, half = 0, 0, 0, 0, None
    with KVStore.open(_settings(settings_factory)) as store:
        while ingested < 10 * budget:
            keys, seed, big = _ingest(store, rng, doc, seed)
            largest = max(largest, big)
            ingested = store.stats()["lmdb_evicted_bytes"] + store.stats()["kv_bytes"]
            if doc % 2:
                assert store.load_chunk(keys[-1]) is not None  # just stored: not evicted yet
            doc += 1
            if half is None and ingested >= 5 * budget:
                half = _file_bytes(store)
        stats = store.stats()
        end = _file_bytes(store)
        assert stats["lmdb_evictions"] > 0 and stats["kv_bytes"] <= budget
        assert end <= budget + 3 * largest + budget // 2, (end, budget, largest)
        assert half is not None and end - half <= largest  # no growth past the first half's churn
        # every document stays ready; none of its evicted chunks is lost, and --repair marks none failed
        docs, total = store.list_documents(limit=10**6)
        assert total == doc and all(d.status == "ready" for d in docs)
        report = check_store(store, repair=True)
        assert report.missing == [] and report.problems == 0 and report.evicted > 0
        _print_check(report, True)
        assert f"evicted by store.lmdb_budget_mb (not lost): {report.evicted}" in capsys.readouterr().out
        assert all(d.status == "ready" for d in store.list_documents(limit=10**6)[0])


def test_evicted_chunks_stay_known_until_their_document_goes(settings_factory) -> None:
    rng = random.Random(1)
    with KVStore.open(_settings(settings_factory)) as store:
        first, seed, _ = _ingest(store, rng, 0, 0)
        doc = 1
        while any(store.has_chunk(k) for k in first):
            _, seed, _ = _ingest(store, rng, doc, seed)
            doc += 1
        with store.env.read() as txn:
            assert all(store.blobs.evicted(txn, k) for k in first)
            assert {i.key for i in store.blobs.infos(txn, first)} == set(first)  # the index lists them
        # a query rebuilds one and stores it again: its document still uses it
        key, blob, *_ = make_blob(*MADE[first[0]])
        assert store.put_kv_referenced([(key, blob)]) == [key]
        assert store.has_chunk(first[0]) and store.stats()["kv_bytes"] <= BUDGET_MB << 20
        # the document goes: its evicted chunks' infos go with it, and none can come back as an orphan
        assert store.delete_document("d0")
        with store.env.read() as txn:
            assert store.blobs.infos(txn, first) == []
        assert store.put_kv_referenced([(key, blob)]) == []
        assert check_store(store).problems == 0


def test_pinned_chunks_are_not_evicted_and_a_reopened_store_keeps_its_bound(settings_factory) -> None:
    rng = random.Random(2)
    settings = _settings(settings_factory, eviction_policy="lru")
    with KVStore.open(settings) as store:
        first, seed, _ = _ingest(store, rng, 0, 0)
        doc = 1
        with store.pinned(first):
            for _ in range(12):  # past the budget several times: LRU would take the oldest, first
                _, seed, _ = _ingest(store, rng, doc, seed)
                doc += 1
            assert all(store.has_chunk(k) for k in first)
        _, seed, _ = _ingest(store, rng, doc, seed)
        doc += 1
    with KVStore.open(settings) as store:  # the policy is seeded from what is stored, oldest first
        assert len(store.blobs.budget.policy) == store.stats()["chunks"]
        for _ in range(12):
            _, seed, _ = _ingest(store, rng, doc, seed)
            doc += 1
        assert not any(store.has_chunk(k) for k in first)
        assert store.stats()["kv_bytes"] <= BUDGET_MB << 20


def test_unreferenced_chunks_go_whole(settings_factory) -> None:
    """A fleet worker's LMDB holds chunks no document of its own refers to: an evicted one leaves no info."""
    with KVStore.open(_settings(settings_factory, budget_mb=2)) as store:
        for seed in range(12):
            key, blob, *_ = make_blob(seed, tokens=48)
            store.put_chunk(key, blob)
        with store.env.read() as txn:
            assert len(store.blobs.infos(txn)) == store.blobs.count(txn) <= 2
        assert store.stats()["kv_bytes"] <= 2 << 20 and store.stats()["lmdb_evictions"] >= 10


@pytest.mark.parametrize("tokens", [200])
def test_a_blob_larger_than_the_budget_is_not_stored(settings_factory, tokens: int) -> None:
    with KVStore.open(_settings(settings_factory, budget_mb=2)) as store:
        store.catalog.put_document(DocumentRecord(id="big", status="processing",
                                                  chunk_keys=[make_blob(0, tokens)[0]]), "text")
        key, blob, *_ = make_blob(0, tokens=tokens)  # 4.6 MB at float16
        assert not store.put_chunk(key, blob)
        assert store.stats()["kv_bytes"] == 0
        store.set_status("big", "ready")  # it counts as evicted: rebuilt from its tokens when read
        assert check_store(store).problems == 0
