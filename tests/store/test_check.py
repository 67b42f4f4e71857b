"""`kvfuse store check [--repair]` and `kvfuse store rebuild-index`: orphans, missing and corrupt blobs."""

from __future__ import annotations

import json

import pytest
from store_kvdata import make_blob

from kvfuse.cli import main
from kvfuse.config import get_settings
from kvfuse.store import KV_LOST, DocumentRecord, KVStore
from kvfuse.store.check import check_store


@pytest.fixture
def cli_env(tmp_path, monkeypatch):
    """Point the process-wide settings (what the CLI reads) at a temp data dir."""
    monkeypatch.setenv("KVFUSE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("KVFUSE_REDIS_URL", "")
    monkeypatch.setenv("KVFUSE_STORE__ORPHAN_GRACE_S", "0")
    get_settings.cache_clear()
    yield monkeypatch
    get_settings.cache_clear()


def _run(capsys, *argv: str) -> tuple[int, dict]:
    rc = main(["store", *argv, "--json"] if argv[0] == "check" else ["store", *argv])
    return rc, json.loads(capsys.readouterr().out)


def test_check_repair_removes_an_orphan(cli_env, capsys) -> None:
    used, blob_used, *_ = make_blob(400)
    orphan, blob_orphan, *_ = make_blob(401)
    with KVStore.open(get_settings()) as store:
        store.put_chunk(used, blob_used)
        store.put_chunk(orphan, blob_orphan)  # as if an ingest died before writing its document
        store.put_document(DocumentRecord(id="d", status="ready", chunk_keys=[used]), text="t")

    rc, report = _run(capsys, "check")
    assert rc == 1 and report["orphans"] == [orphan] and report["problems"] == 1
    rc, report = _run(capsys, "check", "--repair")
    assert rc == 0 and any("deleted 1" in r for r in report["repaired"])
    rc, report = _run(capsys, "check")
    assert rc == 0 and report["problems"] == 0 and report["chunks"] == 1
    with KVStore.open(get_settings()) as store:
        assert not store.has_chunk(orphan) and store.load_chunk(used) is not None
        assert store.stats()["kv_bytes"] == len(blob_used)


def test_young_orphans_are_left_alone(cli_env, capsys) -> None:
    cli_env.setenv("KVFUSE_STORE__ORPHAN_GRACE_S", "3600")
    get_settings.cache_clear()
    key, blob, *_ = make_blob(402)
    with KVStore.open(get_settings()) as store:
        store.put_chunk(key, blob)  # an ingest in flight may claim it any moment
    rc, report = _run(capsys, "check", "--repair")
    assert rc == 0 and report["young_orphans"] == [key] and report["orphans"] == []
    with KVStore.open(get_settings()) as store:
        assert store.has_chunk(key)


def test_rebuild_index_command(cli_env, capsys, redis_url, redis_namespace) -> None:
    cli_env.setenv("KVFUSE_REDIS_URL", redis_url)
    cli_env.setenv("KVFUSE_STORE__REDIS_NAMESPACE", redis_namespace)
    get_settings.cache_clear()
    key, blob, *_ = make_blob(403)
    with KVStore.open(get_settings()) as store:
        store.put_chunk(key, blob)
        store.put_document(DocumentRecord(id="d", status="ready", chunk_keys=[key]), text="t")
    rc, out = _run(capsys, "rebuild-index")
    assert rc == 0 and out == {"index": "redis", "documents": 1, "chunks": 1}


def test_repair_marks_documents_with_lost_blobs_failed(store_settings) -> None:
    gone, blob_gone, *_ = make_blob(410)
    bad, blob_bad, *_ = make_blob(411)
    fine, blob_fine, *_ = make_blob(412)
    with KVStore.open(store_settings()) as store:
        for key, blob in ((gone, blob_gone), (bad, blob_bad), (fine, blob_fine)):
            store.put_chunk(key, blob)
        store.put_document(DocumentRecord(id="lost", status="ready", chunk_keys=[gone, fine]), text="lost")
        store.put_document(DocumentRecord(id="rotten", status="ready", chunk_keys=[bad]), text="rotten")
        store.put_document(DocumentRecord(id="ok", status="ready", chunk_keys=[fine]), text="ok")
        flipped = bytearray(blob_bad)
        flipped[-1] ^= 0xFF

        def damage(txn) -> None:  # what a failing disk or a bad restore does behind the store's back
            txn.delete(gone.encode(), db=store.env.db("chunks"))
            txn.put(bad.encode(), bytes(flipped), db=store.env.db("chunks"))

        store.env.write(damage)
        report = check_store(store)
        assert report.missing == [("lost", gone)] and [k for k, _ in report.corrupt] == [bad]
        check_store(store, repair=True)
        for doc_id in ("lost", "rotten"):
            doc = store.get_document(doc_id)
            assert doc.status == "failed" and doc.error.startswith(KV_LOST)
            assert store.get_text(doc_id) == doc_id  # kept: the service re-ingests from it
        assert store.get_document("ok").status == "ready"
        assert not store.has_chunk(bad) and store.has_chunk(fine)
        assert check_store(store).problems == 0
