"""A data dir that cannot be written gives a clear StoreReadOnlyError; a read-only open still reads."""

from __future__ import annotations

import os

import pytest
import torch
from store_kvdata import make_blob, make_readonly

from kvfuse.store import DocumentRecord, KVStore, StoreError, StoreReadOnlyError


def test_fresh_data_dir_on_readonly_storage(readonly_dir, settings_factory) -> None:
    src, ro = readonly_dir
    make_readonly(src)
    with pytest.raises(StoreReadOnlyError, match="not writable") as err:
        KVStore.open(settings_factory(data_dir=ro / "data"))
    assert str(ro / "data" / "lmdb") in str(err.value) and "KVFUSE_DATA_DIR" in str(err.value)


def test_existing_store_on_readonly_storage(readonly_dir, settings_factory) -> None:
    src, ro = readonly_dir
    key, blob, k, *_ = make_blob(300)
    with KVStore.open(settings_factory(data_dir=src / "data")) as store:
        store.put_chunk(key, blob)
        store.put_document(DocumentRecord(id="d", status="ready", chunk_keys=[key]), text="t")
    make_readonly(src)
    with pytest.raises(StoreReadOnlyError, match="not writable"):
        KVStore.open(settings_factory(data_dir=ro / "data"))
    if os.geteuid() == 0:  # a read-only filesystem: LMDB reads without its lock file
        with KVStore.open(settings_factory(data_dir=ro / "data"), readonly=True) as store:
            assert torch.equal(store.load_chunk(key).k, k.half())
            assert store.get_document("d").chunk_keys == [key]
            with pytest.raises(StoreReadOnlyError, match="read-only"):
                store.put_chunk(key, blob)


def test_readonly_open_of_a_missing_store(settings_factory, tmp_path) -> None:
    with pytest.raises(StoreError, match="no store"):
        KVStore.open(settings_factory(data_dir=tmp_path / "nothing"), readonly=True)
