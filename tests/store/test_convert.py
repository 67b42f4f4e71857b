"""`kvfuse store convert --kv-dtype FORMAT`: every stored chunk rewritten in another KV format in place,
without the model; stopped part way (--limit, or SIGKILL) the store stays whole, a Redis index agrees
with LMDB once the store is opened again, and a second run goes on; damaged blobs, blobs an unfinished
job staged and orphans are left alone and said so."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from store_kvdata import FINGERPRINT, make_kv

from kvfuse import kv_formats, kvblob
from kvfuse.cli import main
from kvfuse.config import get_settings
from kvfuse.store import DocumentRecord, KVStore
from kvfuse.store.check import check_store
from kvfuse.store.jobs import JobRecord


@pytest.fixture
def cli_env(tmp_path, monkeypatch, backend, request):
    """The CLI's settings on a temp data dir, with the parametrized index (embedded or Redis)."""
    monkeypatch.setenv("KVFUSE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("KVFUSE_STORE__ORPHAN_GRACE_S", "0")
    if backend == "redis":
        monkeypatch.setenv("KVFUSE_REDIS_URL", request.getfixturevalue("redis_url"))
        monkeypatch.setenv("KVFUSE_STORE__REDIS_NAMESPACE", request.getfixturevalue("redis_namespace"))
    else:
        monkeypatch.setenv("KVFUSE_REDIS_URL", "")
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def _convert(capsys, *args: str) -> dict:
    assert main(["store", "convert", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def _problems(store: KVStore) -> dict:
    rep = check_store(store)
    return {k: v for k, v in rep.to_dict().items() if v and k not in ("documents", "chunks", "problems")}


def test_convert_is_resumable_and_leaves_every_document_whole(cli_env, capsys) -> None:
    kvs = [make_kv(500 + i, tokens=70) for i in range(6)]
    with KVStore.open(get_settings()) as store:
        keys = [store.put_kv(FINGERPRINT, "float16", ids, k, v, artifacts={"x": torch.arange(2)} if i == 1 else None)[0]
                for i, (k, v, ids) in enumerate(kvs)]
        store.put_document(DocumentRecord(id="a", status="ready", chunk_keys=keys[:3], kv_bytes=3), text="a")
        store.put_document(DocumentRecord(id="b", status="ready", chunk_keys=[keys[2], keys[3]]), text="b")
        job = JobRecord(id="job-1", document_id="c", status="processing", text="c")
        store.jobs.put(job)
        store.jobs.stage(job, [keys[4]])  # an ingest in flight
        orphan = keys[5]
        before = store.stats()["kv_bytes"]

    first = _convert(capsys, "--kv-dtype", "int4", "--limit", "2", "--batch", "1")
    assert first["converted"] == 2 and first["remaining"] >= 2 and first["bytes_after"] < 0.32 * first["bytes_before"]
    with KVStore.open(get_settings()) as store:  # stopped part way: every document still reads, in two formats
        assert _problems(store) == {"orphans": [orphan]}
        formats = set()
        for doc in ("a", "b"):
            for key in store.get_document(doc).chunk_keys:
                k, _, header = store.load_chunk(key)
                formats.add(header.dtype)
        assert formats == {"float16", "int4"}

    second = _convert(capsys, "--kv-dtype", "int4")
    assert second["converted"] == 2 and second["remaining"] == 0
    assert sorted(why for _, why in second["skipped"]) == [
        "no document refers to it (an orphan: kvfuse store check)", "staged by an unfinished ingestion job"]
    with KVStore.open(get_settings()) as store:
        assert _problems(store) == {"orphans": [orphan]}
        a, b = store.get_document("a"), store.get_document("b")
        want = [kvblob.chunk_key(FINGERPRINT, "int4", ids) for _, _, ids in kvs]
        assert a.chunk_keys == want[:3] and b.chunk_keys == [want[2], want[3]]  # the shared chunk: one blob
        assert a.kv_bytes < 3  # the record's byte count follows its blobs
        for i in range(4):
            k, v, header = store.load_chunk(want[i])
            assert header.dtype == "int4" and header.token_hash == kvblob.token_hash(kvs[i][2])
            # from float16 at rest: the same codes as quantizing those float16 values directly
            assert torch.equal(k.dequantize(), kv_formats.quantize(kvs[i][0].half().float(), "int4", 0).dequantize())
        assert torch.equal(store.load_artifacts(want[1]).artifacts["x"], torch.arange(2))
        assert store.has_chunk(keys[4]) and store.has_chunk(orphan) and not store.has_chunk(keys[0])
        assert store.stats()["kv_bytes"] < 0.6 * before  # 4 of 6 blobs at under a third

    assert _convert(capsys, "--kv-dtype", "int4")["converted"] == 0  # nothing left: a third run does nothing


def test_a_damaged_blob_is_left_alone_and_named(cli_env, capsys) -> None:
    k, v, ids = make_kv(520, tokens=40)
    with KVStore.open(get_settings()) as store:
        key, _ = store.put_kv(FINGERPRINT, "float16", ids, k, v)
        store.put_document(DocumentRecord(id="d", status="ready", chunk_keys=[key]), text="d")
        blobs = store.env.db("chunks")

        def flip(txn) -> None:
            raw = bytearray(txn.get(key.encode(), db=blobs))
            raw[-10] ^= 1
            txn.put(key.encode(), bytes(raw), db=blobs)

        store.env.write(flip)
    rep = _convert(capsys, "--kv-dtype", "fp8")
    assert rep["converted"] == 0 and rep["skipped"][0][0] == key and "checksum" in rep["skipped"][0][1]
    with KVStore.open(get_settings()) as store:
        assert store.get_document("d").chunk_keys == [key]  # untouched: `store check --repair` deals with it


def _agrees(store: KVStore) -> bool:
    """Whether the Redis index holds what LMDB holds: the documents, their chunk keys, the chunks and
    their owners."""
    truth, mirror = store.catalog.snapshot(), store.catalog.mirror.snapshot()
    same_docs = all(store.catalog.mirror.get_document(d).chunk_keys == store.catalog.stored_document(d).chunk_keys
                    for d in truth.docs)
    return (truth.docs.keys() == mirror.docs.keys() and truth.chunks == mirror.chunks
            and truth.owners == mirror.owners and same_docs)


@pytest.mark.parametrize("backend", ["redis"])
def test_a_convert_killed_at_any_batch_leaves_redis_and_lmdb_agreeing(cli_env) -> None:
    """SIGKILL after the 1st, then the 3rd batch of the runs that follow (wherever in the next batch the
    signal lands: its re-encoding, its LMDB transaction or its Redis writes): a Redis index that does not
    mirror LMDB is one marked for a rebuild, and opening the store rebuilds it."""
    with KVStore.open(get_settings()) as store:
        for i in range(24):
            k, v, ids = make_kv(600 + i, tokens=120)
            key, _ = store.put_kv(FINGERPRINT, "float16", ids, k, v)
            store.put_document(DocumentRecord(id=f"d{i}", status="ready", chunk_keys=[key]), text=f"d{i}")
    command = [sys.executable, "-m", "kvfuse.cli", "store", "convert", "--kv-dtype", "int8", "--batch", "1"]
    for kill_after in (1, 3, None):
        proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                env=os.environ)
        lines = 0
        while kill_after is not None and lines < kill_after:
            line = proc.stderr.readline()
            assert line, f"convert ended before batch {kill_after}"
            lines += re.fullmatch(r"\d+/\d+", line.strip()) is not None
        if kill_after is not None:
            proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=120)
        assert proc.returncode == (-signal.SIGKILL if kill_after else 0)
        with KVStore.open(get_settings(), readonly=True) as store:  # read-only: looks, rebuilds nothing
            marked = store.catalog.mirror.needs_rebuild(store.catalog.store_id)
            assert marked or _agrees(store)
            finished = {kvblob.read_header(b).dtype for _, b in _blobs(store)} == {"int8"}
            assert marked != finished  # a run cut short leaves the index marked, whatever it holds
        with KVStore.open(get_settings()) as store:  # a restart: the index is LMDB's again
            assert _agrees(store) and not store.catalog.mirror.needs_rebuild(store.catalog.store_id)
            assert _problems(store) == {}
            formats = {kvblob.read_header(b).dtype for _, b in _blobs(store)}
            assert formats == ({"int8"} if kill_after is None else {"int8", "float16"})


def _blobs(store: KVStore) -> list:
    with store.env.read() as txn:
        return [(k, bytes(b)) for k, b in store.blobs.scan(txn)]
