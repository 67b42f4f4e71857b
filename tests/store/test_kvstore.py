"""KVStore over real LMDB in a temp dir, once with the embedded index and once with the real Redis."""

from __future__ import annotations

import pytest
import torch
from store_kvdata import FINGERPRINT, make_blob

from kvfuse import kvblob
from kvfuse.store import (
    CorruptBlobError,
    DocumentNotFoundError,
    DocumentRecord,
    KVStore,
    StoreError,
)


@pytest.fixture
def store(store_settings):
    with KVStore.open(store_settings()) as s:
        yield s


def _doc(doc_id: str, keys: list[str], status: str = "ready") -> DocumentRecord:
    return DocumentRecord(id=doc_id, status=status, chunk_keys=keys, chunk_tokens=[16] * len(keys),
                          tokens=16 * len(keys), metadata={"source": doc_id})


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_chunk_round_trip_through_lmdb_and_hot_tier(store: KVStore, dtype: str) -> None:
    key, blob, k, v, _ = make_blob(10, dtype=dtype)
    assert store.put_chunk(key, blob) is True
    assert store.put_chunk(key, blob) is False  # content-addressed: stored once
    assert store.has_chunk(key)
    k2, v2, h = store.load_chunk(key)  # cold: from LMDB
    tdt = kvblob.DTYPES[dtype][0]
    assert torch.equal(k2, k.to(tdt)) and torch.equal(v2, v.to(tdt)) and h.dtype == dtype
    again = store.load_chunk(key)  # hot
    assert again[0] is k2
    st = store.stats()
    assert (st["hot_hits"], st["hot_misses"], st["chunks"], st["kv_bytes"]) == (1, 1, 1, len(blob))


def test_model_or_dtype_mismatch_is_a_miss(store: KVStore) -> None:
    key, blob, _, _, ids = make_blob(11)
    store.put_chunk(key, blob)
    assert store.load_chunk(kvblob.chunk_key("another-model", "float16", ids)) is None
    assert store.load_chunk(kvblob.chunk_key(FINGERPRINT, "bfloat16", ids)) is None
    assert not store.has_chunk(kvblob.chunk_key("another-model", "float16", ids))
    assert store.load_chunk(key) is not None


def test_a_blob_under_a_foreign_key_is_refused(store: KVStore) -> None:
    key_a, blob_a, *_ = make_blob(12)
    key_b, _, *_ = make_blob(13)
    with pytest.raises(ValueError):
        store.put_chunk(key_b, blob_a)
    # put behind the store's back (as a bug or a bad restore would): reading it is an error, not a hit
    store.env.write(lambda txn: txn.put(key_b.encode(), blob_a, db=store.env.db("chunks")))
    with pytest.raises(CorruptBlobError, match="belongs under"):
        store.load_chunk(key_b)


def test_a_corrupted_byte_on_disk_raises_and_put_replaces_it(store: KVStore) -> None:
    key, blob, k, _, _ = make_blob(14)
    store.put_chunk(key, blob)
    bad = bytearray(blob)
    bad[len(bad) // 2] ^= 0x40
    store.env.write(lambda txn: txn.put(key.encode(), bytes(bad), db=store.env.db("chunks")))
    with pytest.raises(CorruptBlobError, match="checksum"):
        store.load_chunk(key)
    assert store.put_chunk(key, blob) is True  # the rebuilt blob replaces the corrupt one
    assert torch.equal(store.load_chunk(key).k, k.half())


def test_shared_chunk_is_stored_once_and_kept_until_its_last_document_goes(store: KVStore) -> None:
    shared, blob_s, *_ = make_blob(20)
    own_a, blob_a, *_ = make_blob(21)
    own_b, blob_b, *_ = make_blob(22)
    for key, blob in ((shared, blob_s), (own_a, blob_a), (own_b, blob_b)):
        store.put_chunk(key, blob)
    assert store.put_chunk(shared, blob_s) is False
    store.put_document(_doc("a", [shared, own_a]), text="text of a")
    store.put_document(_doc("b", [own_b, shared]), text="text of b")
    store.load_chunk(shared)
    assert store.stats()["chunks"] == 3

    assert store.delete_document("a") is True
    assert store.get_document("a") is None and store.get_text("a") is None
    assert not store.has_chunk(own_a)  # its own blob went, from LMDB and the hot tier
    assert store.has_chunk(shared) and store.load_chunk(shared) is not None  # b still uses it
    assert store.delete_document("a") is False

    assert store.delete_document("b") is True
    assert not store.has_chunk(shared) and not store.has_chunk(own_b)
    st = store.stats()
    assert (st["documents"], st["chunks"], st["kv_bytes"], st["hot_items"]) == (0, 0, 0, 0)


def test_documents_status_listing_and_text(store: KVStore) -> None:
    key, blob, *_ = make_blob(30)
    store.put_document(_doc("d1", [], status="pending"), text="héllo wörld")
    rec = store.get_document("d1")
    assert rec.status == "pending" and rec.created_at > 0 and rec.metadata == {"source": "d1"}
    assert store.get_text("d1") == "héllo wörld"
    with pytest.raises(StoreError, match="missing"):
        store.set_status("d1", "ready", chunk_keys=[key], chunk_tokens=[16])  # blob not stored yet
    store.put_chunk(key, blob)
    store.set_status("d1", "ready", chunk_keys=[key], chunk_tokens=[16], tokens=16, kv_bytes=len(blob))
    rec2 = store.get_document("d1")
    assert (rec2.status, rec2.chunk_keys, rec2.kv_bytes, rec2.created_at) == ("ready", [key], len(blob), rec.created_at)
    assert rec2.updated_at >= rec.updated_at
    store.set_status("d1", "failed", error="boom")
    assert store.get_document("d1").error == "boom"
    with pytest.raises(DocumentNotFoundError):
        store.set_status("nope", "ready")
    with pytest.raises(ValueError):
        store.set_status("d1", "ready", id="other")
    with pytest.raises(ValueError):
        store.put_document(_doc("d2", []))  # a new document needs its text

    for i in range(2, 7):
        store.put_document(_doc(f"d{i}", [], status="pending"), text=f"t{i}")
    page, total = store.list_documents(offset=1, limit=3)
    assert total == 6 and [d.id for d in page] == ["d2", "d3", "d4"]  # creation order
    assert store.list_documents(offset=10)[0] == []


def test_overwrite_drops_chunks_the_document_no_longer_uses(store: KVStore) -> None:
    old, blob_old, *_ = make_blob(40)
    new, blob_new, *_ = make_blob(41)
    store.put_chunk(old, blob_old)
    store.put_chunk(new, blob_new)
    store.put_document(_doc("d", [old]), text="v1")
    store.put_document(_doc("d", [new]), text="v2")
    assert not store.has_chunk(old) and store.has_chunk(new)
    assert store.get_text("d") == "v2" and store.get_document("d").chunk_keys == [new]
    assert store.list_documents()[1] == 1


def test_map_grows_past_a_tiny_initial_size(store_settings) -> None:
    settings = store_settings(store={"lmdb_map_size_mb": 1})
    with KVStore.open(settings) as store:
        keys = []
        for i in range(12):  # 12 x 184 KB (fp16) = 2.2 MB > 1 MB
            key, blob, *_ = make_blob(100 + i, tokens=16)
            store.put_chunk(key, blob)
            keys.append(key)
        store.put_document(_doc("big", keys), text="x" * 500_000)
        st = store.stats()
        assert st["lmdb_map_bytes"] > 1 << 20 and st["chunks"] == 12
    with KVStore.open(settings) as store:  # reopened with the small setting: the file's size wins
        assert all(store.load_chunk(k) is not None for k in keys)
        assert store.get_document("big").chunk_keys == keys


def test_a_chunk_repeated_within_a_document(store: KVStore) -> None:
    key, blob, *_ = make_blob(60)
    store.put_chunk(key, blob)
    store.put_document(_doc("rep", [key, key]), text="same paragraph twice")
    assert store.get_document("rep").chunk_keys == [key, key]
    assert store.delete_document("rep") and not store.has_chunk(key)


def test_documents_list_by_collection_and_move_between_them(store: KVStore) -> None:
    from dataclasses import replace

    for i in range(5):
        store.put_document(replace(_doc(f"c{i}", [], status="pending"), collection="odd" if i % 2 else "even"),
                           text=f"t{i}")
    store.put_document(_doc("plain", [], status="pending"), text="t")
    assert store.get_document("plain").collection == "default"
    page, total = store.list_documents(collection="even", offset=1, limit=1)
    assert total == 3 and [d.id for d in page] == ["c2"]
    assert [d.id for d in store.list_documents(collection="odd")[0]] == ["c1", "c3"]
    assert store.list_documents(collection="none") == ([], 0)
    store.put_document(replace(store.get_document("c1"), collection="even"))  # an overwrite moves it
    assert store.list_documents(collection="odd")[1] == 1 and store.list_documents(collection="even")[1] == 4
    store.delete_document("c3")
    assert store.list_documents(collection="odd") == ([], 0)
    assert store.list_documents()[1] == 5
