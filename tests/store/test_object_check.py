"""`kvfuse store check` and `kvfuse store convert` over the object store tier (real SeaweedFS): a chunk
LMDB lost but the object store holds is not lost; chunks in use missing from the object store are
uploaded by --repair; unused objects are listed for deletion after the grace, never one in use; convert
uploads the new blobs and lists the old objects as orphans."""

from __future__ import annotations

import pytest
from store_kvdata import make_blob

from kvfuse import kvblob
from kvfuse.store import KVStore
from kvfuse.store.check import check_store
from kvfuse.store.convert import convert_store
from kvfuse.store.errors import StoreError
from kvfuse.store.lmdb_tier import LmdbTier
from kvfuse.store.records import DocumentRecord


def _doc(doc_id: str, keys: list[str]) -> DocumentRecord:
    return DocumentRecord(id=doc_id, status="ready", chunk_keys=keys, chunk_tokens=[16] * len(keys),
                          tokens=16 * len(keys))


def _open(settings_factory, object_store_settings, **store) -> KVStore:
    return KVStore.open(settings_factory(object_store=object_store_settings, store=store))


def test_check_counts_the_object_store_and_repair_uploads_and_lists(settings_factory, object_store_settings) -> None:
    with _open(settings_factory, object_store_settings, orphan_grace_s=3600) as store:
        evicted, blob_e, *_ = make_blob(30)
        unsent, blob_u, *_ = make_blob(31)
        stray, blob_s, *_ = make_blob(32)
        store.put_chunk(evicted, blob_e)
        LmdbTier.put(store.blobs, unsent, kvblob.decode(blob_u))  # stored before the object store was set
        store.objects.client.put(stray, blob_s)  # an object nothing uses, not listed (a crash, another run)
        store.put_document(_doc("d", [evicted, unsent]), text="d")
        LmdbTier.remove(store.blobs, evicted)  # gone from LMDB (a budget's eviction): the object still holds it
        rep = check_store(store)
        assert rep.objects == 2 and rep.missing == []  # `evicted` is held by the object store
        assert rep.object_missing == [unsent] and rep.object_orphans == [stray]
        rep = check_store(store, repair=True)
        assert store.objects.client.exists(unsent) and store.get_document("d").status == "ready"
        assert set(store.objects.listed("orphans")) == {stray}
        assert check_store(store).problems == 0
        store.objects.client.delete(evicted)  # now in no tier at all: that is lost
        assert check_store(store).missing == [("d", evicted)]


def test_convert_uploads_the_new_blobs_and_lists_the_old_objects(settings_factory, object_store_settings) -> None:
    with _open(settings_factory, object_store_settings, orphan_grace_s=0) as store:
        key, blob, *_ = make_blob(33, dtype="float16")
        store.put_chunk(key, blob)
        store.put_document(_doc("d", [key]), text="d")
        rep = convert_store(store, "int8")
        assert rep.converted == 1
        new = store.get_document("d").chunk_keys[0]
        assert new != key and store.objects.client.exists(new) and store.objects.listed("pending") == {}
        assert set(store.objects.listed("orphans")) == {key}
        assert store.objects.reap_orphans() == 1 and not store.objects.client.exists(key)
        assert kvblob.read_header(bytes(store.objects.client.get(new))).dtype == "int8"


def test_ready_check_and_store_check_hold_a_chunk_by_the_same_rule(settings_factory, object_store_settings) -> None:
    """records.unheld_chunks: a chunk only the object store holds lets its document be ready, and store
    check does not call it missing; a chunk in no tier refuses `ready`, unless the document is first-use."""
    with _open(settings_factory, object_store_settings) as store:
        only_object, blob, *_ = make_blob(34)
        store.objects.client.put(only_object, blob)  # written by another host: not in this LMDB, not evicted
        store.put_document(_doc("d", [only_object]), text="d")
        assert store.get_document("d").status == "ready"
        assert check_store(store).missing == []
        nowhere, *_ = make_blob(35)
        with pytest.raises(StoreError, match="cannot be ready"):
            store.put_document(_doc("e", [nowhere]), text="e")
        first_use = DocumentRecord(id="f", status="ready", chunk_keys=[nowhere], chunk_tokens=[16], tokens=16,
                                   precompute_at="first_use")
        store.put_document(first_use, text="f")
        assert check_store(store).missing == []
        store.objects.client.delete(only_object)
        assert check_store(store).missing == [("d", only_object)]


def test_the_ready_check_asks_the_object_store_outside_any_write_transaction(settings_factory,
                                                                             object_store_settings) -> None:
    """object_holds.py: the ready check's HEADs run before the write transaction, so another writer is not
    held behind them; the answer is the same rule's (a chunk only the object store holds lets its document
    be ready, through put_document and set_status alike; one in no tier refuses it)."""
    import threading

    with _open(settings_factory, object_store_settings) as store:
        head = store.catalog.in_objects
        asked: list[tuple[str, bool]] = []

        def probing(key: str) -> bool:  # the real HEAD, after checking that another thread can write now
            t = threading.Thread(target=store.catalog.env.write, args=(lambda txn: None,), daemon=True)
            t.start()
            t.join(timeout=20)
            asked.append((key, not t.is_alive()))
            return head(key)

        store.catalog.in_objects = probing
        only_object, blob, *_ = make_blob(36)
        store.objects.client.put(only_object, blob)
        store.put_document(_doc("d", [only_object]), text="d")
        assert store.get_document("d").status == "ready"
        later, blob_l, *_ = make_blob(37)
        store.objects.client.put(later, blob_l)
        store.put_document(DocumentRecord(id="p", status="pending"), text="p")
        store.catalog.set_status("p", "ready", chunk_keys=[later], chunk_tokens=[16], tokens=16)
        assert store.get_document("p").status == "ready"
        nowhere, *_ = make_blob(38)
        with pytest.raises(StoreError, match="cannot be ready"):
            store.put_document(_doc("e", [nowhere]), text="e")
        assert store.get_document("e") is None
        assert asked == [(only_object, True), (later, True), (nowhere, True)]
