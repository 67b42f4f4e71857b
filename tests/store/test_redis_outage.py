"""A Redis that goes away mid-session and comes back empty: the store says so while it is down
(IndexUnavailableError, never a wrong answer), then rebuilds the index from LMDB once it answers.

A private redis-server on a free port (no persistence) is started and stopped by the test, so the
shared server on 6379 is never disturbed."""

from __future__ import annotations

import subprocess

import pytest
import redis
from redis_server import free_port, start_redis
from store_kvdata import make_blob

from kvfuse.store import DocumentRecord, IndexUnavailableError, KVStore


def _stop(proc: subprocess.Popen, port: int | None = None) -> None:
    """Stop the server; with `port`, save its data first (a restart then comes back with it)."""
    if port is not None:
        try:
            redis.Redis(port=port).shutdown(save=True)
        except redis.ConnectionError:
            pass  # the server closes the connection as it exits
    else:
        proc.terminate()
    proc.wait(timeout=10)


@pytest.mark.slow
def test_outage_then_empty_restart(settings_factory, tmp_path) -> None:
    port = free_port()
    settings = settings_factory(redis_url=f"redis://127.0.0.1:{port}/0",
                                store={"redis_namespace": "outage", "redis_timeout_s": 1})
    proc = start_redis(port, tmp_path)
    try:
        with KVStore.open(settings) as store:
            a, blob_a, *_ = make_blob(500)
            store.put_chunk(a, blob_a)
            store.put_document(DocumentRecord(id="a", status="ready", chunk_keys=[a]), text="a")

            _stop(proc)
            with pytest.raises(IndexUnavailableError, match=f"127.0.0.1:{port}"):
                store.get_document("a")
            with pytest.raises(IndexUnavailableError):
                store.list_documents()
            with pytest.raises(IndexUnavailableError):  # LMDB took it; the mirror write failed
                store.put_document(DocumentRecord(id="b", status="pending"), text="b")
            with pytest.raises(IndexUnavailableError):  # nothing is deleted while the index is down
                store.delete_document("a")
            assert store.load_chunk(a) is not None  # KV reads need only LMDB

            proc = start_redis(port, tmp_path)  # back, and empty
            docs, total = store.list_documents()
            assert total == 2 and {d.id for d in docs} == {"a", "b"}  # rebuilt from LMDB
            assert store.get_document("b").status == "pending"
            assert store.delete_document("a") and store.get_document("a") is None
    finally:
        if proc.poll() is None:
            _stop(proc)


@pytest.mark.slow
def test_outage_then_restart_with_old_data_is_caught_up(settings_factory, tmp_path) -> None:
    """Redis comes back with its data (saved at shutdown) but without the writes missed meanwhile:
    the store knows a mirror write failed and rebuilds although the index is not empty."""
    port = free_port()
    settings = settings_factory(redis_url=f"redis://127.0.0.1:{port}/0",
                                store={"redis_namespace": "blip", "redis_timeout_s": 1})
    proc = start_redis(port, tmp_path)
    try:
        with KVStore.open(settings) as store:
            store.put_document(DocumentRecord(id="a", status="pending"), text="a")
            _stop(proc, port)
            with pytest.raises(IndexUnavailableError):
                store.put_document(DocumentRecord(id="b", status="pending"), text="b")
            proc = start_redis(port, tmp_path)
            assert redis.Redis(port=port).zrange("blip:docs", 0, -1) == [b"a"]  # old data is back
            assert {d.id for d in store.list_documents()[0]} == {"a", "b"}
    finally:
        if proc.poll() is None:
            _stop(proc)


@pytest.mark.slow
def test_an_empty_restart_no_call_saw_is_noticed_and_rebuilt(settings_factory, tmp_path) -> None:
    """Redis restarts empty between two calls, so no call failed: a miss, a listing and the readiness
    probe notice the marker is gone and rebuild from LMDB, instead of answering that nothing exists."""
    port = free_port()
    settings = settings_factory(redis_url=f"redis://127.0.0.1:{port}/0",
                                store={"redis_namespace": "unseen", "redis_timeout_s": 1})
    proc = start_redis(port, tmp_path)
    try:
        with KVStore.open(settings) as store:
            for doc_id in ("a", "b"):
                store.put_document(DocumentRecord(id=doc_id, status="pending"), text=doc_id)
            for check in (lambda: store.get_document("a") is not None,
                          lambda: store.list_documents()[1] == 2,
                          lambda: store.catalog.index_available() and store.get_document("b") is not None):
                _stop(proc)
                proc = start_redis(port, tmp_path)  # back, and empty, unseen by the store
                assert redis.Redis(port=port).zrange("unseen:docs", 0, -1) == []
                assert check()
            _stop(proc)
            proc = start_redis(port, tmp_path)
            store.put_document(DocumentRecord(id="c", status="pending"), text="c")  # a write lands first
            assert store.get_document("a") is not None and store.list_documents()[1] == 3
    finally:
        if proc.poll() is None:
            _stop(proc)
