"""The Redis index mirrors LMDB: rebuilt when it comes up empty, clear errors when Redis is down."""

from __future__ import annotations

import pytest
import redis
from store_kvdata import make_blob

from kvfuse.store import DocumentRecord, IndexUnavailableError, KVStore
from kvfuse.store.check import check_store


def _fill(store: KVStore, n: int = 3) -> list[str]:
    keys = []
    for i in range(n):
        key, blob, *_ = make_blob(200 + i)
        store.put_chunk(key, blob)
        store.put_document(DocumentRecord(id=f"doc{i}", status="ready", chunk_keys=[key], chunk_tokens=[16]),
                           text=f"text {i}")
        keys.append(key)
    return keys


def _drop_namespace(url: str, ns: str) -> int:
    """What FLUSHDB does to this store's keys, limited to this test's namespace: the server is shared,
    so the real FLUSHDB is never run."""
    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match=f"{ns}:*"))
    if keys:
        client.delete(*keys)
    return len(keys)


def test_index_is_rebuilt_from_lmdb_after_a_flush(settings_factory, redis_url, redis_namespace) -> None:
    settings = settings_factory(redis_url=redis_url, store={"redis_namespace": redis_namespace})
    with KVStore.open(settings) as store:
        keys = _fill(store)
    assert _drop_namespace(redis_url, redis_namespace) > 0  # emulates FLUSHDB of this namespace
    with KVStore.open(settings) as store:  # rebuild_index_on_empty (default on)
        docs, total = store.list_documents()
        assert total == 3 and [d.id for d in docs] == ["doc0", "doc1", "doc2"]
        assert store.get_document("doc1").chunk_keys == [keys[1]]
        assert store.catalog.mirror.snapshot().chunks == set(keys)
        assert check_store(store).problems == 0


def test_rebuild_by_hand_when_automatic_rebuild_is_off(settings_factory, redis_url, redis_namespace) -> None:
    settings = settings_factory(
        redis_url=redis_url, store={"redis_namespace": redis_namespace, "rebuild_index_on_empty": False}
    )
    with KVStore.open(settings) as store:
        _fill(store, 2)
    _drop_namespace(redis_url, redis_namespace)
    with KVStore.open(settings) as store:
        assert store.list_documents()[1] == 0  # the empty index, as configured
        assert len(check_store(store).index_drift) > 0
        assert store.rebuild_index() == {"index": "redis", "documents": 2, "chunks": 2}
        assert store.list_documents()[1] == 2 and check_store(store).problems == 0


def test_a_namespace_of_another_store_is_replaced(settings_factory, redis_url, redis_namespace, tmp_path) -> None:
    first = settings_factory(redis_url=redis_url, store={"redis_namespace": redis_namespace})
    with KVStore.open(first) as store:
        _fill(store, 2)
    other = settings_factory(data_dir=tmp_path / "other", redis_url=redis_url,
                             store={"redis_namespace": redis_namespace})
    with KVStore.open(other) as store:  # a new LMDB store: the index must not show the first one's docs
        assert store.list_documents()[1] == 0


def test_refused_connection_is_index_unavailable(settings_factory) -> None:
    # Port 1 on loopback: nothing listens there, the kernel refuses the connection.
    settings = settings_factory(redis_url="redis://:secret@127.0.0.1:1/0", store={"redis_timeout_s": 2})
    with pytest.raises(IndexUnavailableError) as err:
        KVStore.open(settings)
    assert "127.0.0.1:1" in str(err.value) and "secret" not in str(err.value)


def test_drift_is_found_and_repaired(settings_factory, redis_url, redis_namespace) -> None:
    settings = settings_factory(redis_url=redis_url, store={"redis_namespace": redis_namespace})
    with KVStore.open(settings) as store:
        _fill(store, 2)
        client = redis.Redis.from_url(redis_url)
        client.delete(f"{redis_namespace}:doc:doc0")
        client.zrem(f"{redis_namespace}:docs", "doc0")
        client.sadd(f"{redis_namespace}:chunks", "f" * 64)
        report = check_store(store)
        assert "document 'doc0' only in LMDB" in report.index_drift
        assert f"chunk {'f' * 64} only in the index" in report.index_drift
        repaired = check_store(store, repair=True)
        assert any("rebuilt the redis index" in r for r in repaired.repaired)
        assert check_store(store).problems == 0 and store.get_document("doc0") is not None
