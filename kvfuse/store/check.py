"""`kvfuse store check [--repair]`: compare everything the store holds with what its documents need.

Finds: orphan blobs (no document or unfinished ingestion job refers to them), missing blobs and corrupt
blobs (checksum, or stored under a key that is not their own) of `ready` documents (a blob the LMDB budget
evicted is not missing: its info says so, and a query rebuilds it from its token ids or reads it from a
lower tier; `evicted` counts them), blobs of another model
(their header's fingerprint is not the one the service last recorded in the store's meta), chunk refs that disagree with the documents,
the kv_bytes counter, and index/LMDB drift.

With an object store (object_tier.py): chunks documents use that are in no object (and not pending
upload), and objects no document uses that are not listed for deletion. A `ready` document's chunk is
missing only when neither LMDB nor the object store holds it. Objects are listed, not downloaded: their
checksums are verified when they are read. An empty catalog (a fleet worker's data dir) judges no object.

Repair: rewrites the refs from the documents, deletes orphans older than `store.orphan_grace_s` (a
younger one may belong to an ingest that has not written its document yet) and corrupt blobs and those of another model, marks each
`ready` document with a missing, corrupt or foreign blob `failed` with an error starting with `kv_lost`
(its chunk keys and text are kept: the service re-ingests it from the stored text at its next start), recounts kv_bytes and
rebuilds the index from LMDB.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import lmdb

from kvfuse.kvblob import CorruptBlobError, verify_blob
from kvfuse.store.kvstore import KVStore
from kvfuse.store.lmdb_tier import check_key
from kvfuse.store.records import KV_LOST, DocumentRecord, unheld_chunks


@dataclass
class CheckReport:
    documents: int = 0
    chunks: int = 0
    orphans: list[str] = field(default_factory=list)  # old enough to delete
    young_orphans: list[str] = field(default_factory=list)  # within the grace period: left alone
    missing: list[tuple[str, str]] = field(default_factory=list)  # (doc id, chunk key)
    corrupt: list[tuple[str, str]] = field(default_factory=list)  # (chunk key, reason)
    foreign: list[str] = field(default_factory=list)  # blobs of another model than the store's (fingerprint)
    ref_drift: int = 0  # refs entries to add or remove
    kv_bytes_drift: int = 0  # counter minus the real sum
    index_drift: list[str] = field(default_factory=list)
    objects: int = 0  # in the object store, when one is configured
    object_missing: list[str] = field(default_factory=list)  # used, in no object, not pending upload
    object_orphans: list[str] = field(default_factory=list)  # in the object store, unused, not listed
    repaired: list[str] = field(default_factory=list)
    evicted: int = 0  # chunks of documents the LMDB budget evicted (not a problem: not lost)

    @property
    def problems(self) -> int:
        return (
            len(self.orphans) + len(self.missing) + len(self.corrupt) + len(self.foreign) + self.ref_drift
            + bool(self.kv_bytes_drift) + len(self.index_drift) + len(self.object_missing) + len(self.object_orphans)
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"problems": self.problems}


def _index_drift(store: KVStore) -> list[str]:
    mirror = store.catalog.mirror
    if mirror is None:  # the embedded index is the LMDB records: nothing to drift
        return []
    truth, copy = store.catalog.snapshot(), mirror.snapshot()
    drift = []
    for doc_id in sorted(truth.docs.keys() ^ copy.docs.keys()):
        where = "LMDB" if doc_id in truth.docs else "the index"
        drift.append(f"document {doc_id!r} only in {where}")
    drift += [f"document {d!r} differs" for d in sorted(truth.docs.keys() & copy.docs.keys())
              if truth.docs[d] != copy.docs[d]]
    drift += [f"chunk {k} only in LMDB" for k in sorted(truth.chunks - copy.chunks)]
    drift += [f"chunk {k} only in the index" for k in sorted(copy.chunks - truth.chunks)]
    drift += [f"owners of chunk {k} differ" for k in sorted(truth.owners.keys() | copy.owners.keys())
              if truth.owners.get(k) != copy.owners.get(k)]
    return drift


def check_store(store: KVStore, *, repair: bool = False, grace_s: float | None = None) -> CheckReport:
    grace = store.settings.store.orphan_grace_s if grace_s is None else grace_s
    catalog, blobs = store.catalog, store.blobs
    rep = CheckReport()
    now = time.time()
    model = store.model_fingerprint()  # "" until a service ran on this store: nothing is foreign then
    with store.env.read() as txn:  # one transaction: documents, refs and blobs as of one moment
        docs = catalog.documents(txn)
        wanted = {(k, d.id) for d in docs.values() for k in d.chunk_keys} | store.jobs.staged_refs(txn)
        refs = catalog.refs(txn)
        referenced = {k for k, _ in wanted}
        stored: set[str] = set()
        real_bytes = 0
        for key, blob in blobs.scan(txn):
            stored.add(key)
            real_bytes += len(blob)
            try:
                header = verify_blob(blob)
                check_key(key, header.key)
                if model and header.model_fingerprint != model:
                    rep.foreign.append(key)
            except CorruptBlobError as err:
                rep.corrupt.append((key, str(err)))
            if key not in referenced:
                info = blobs.info(txn, key)
                created = info.created_at if info is not None else 0.0
                (rep.young_orphans if now - created < grace else rep.orphans).append(key)
        rep.kv_bytes_drift = blobs.kv_bytes(txn) - real_bytes
        evicted = {k for k in referenced if k not in stored and blobs.evicted(txn, k)}
    rep.documents, rep.chunks = len(docs), len(stored)
    rep.ref_drift = len(wanted ^ refs)
    corrupt = {k for k, _ in rep.corrupt} | set(rep.foreign)  # a foreign blob is as useless as a corrupt one
    rep.evicted = len(evicted)
    objects = _check_objects(store, rep, referenced) if store.objects is not None else None
    rep.missing = sorted(
        (d.id, k) for d in docs.values()
        for k in unheld_chunks(d, lambda k: k in stored or k in evicted, None if objects is None else objects.__contains__)
    )
    rep.index_drift = _index_drift(store)
    if repair and rep.problems:
        _repair(store, rep, docs, wanted, corrupt, stored)
    return rep


def _check_objects(store: KVStore, rep: CheckReport, referenced: set[str]) -> set[str]:
    """The object store's keys (probes left out); fills rep's object fields."""
    objects = store.objects
    assert objects is not None
    keys = {k for k in objects.client.keys() if not k.startswith("probe-")}
    rep.objects = len(keys)
    pending, listed = objects.listed("pending"), objects.listed("orphans")
    rep.object_missing = sorted(k for k in referenced if k not in keys and k not in pending)
    if referenced:  # an empty catalog (a fleet worker's) says nothing about whose objects these are
        rep.object_orphans = sorted(k for k in keys - referenced if k not in listed)
    return keys


def _repair_objects(store: KVStore, rep: CheckReport, stored: set[str]) -> None:
    """List the used chunks in no object for upload (from this host's copy) and the unused objects for
    deletion after the orphan grace; then upload what can be."""
    objects = store.objects
    assert objects is not None
    up = [k for k in rep.object_missing if k in stored]

    def fn(txn: lmdb.Transaction) -> None:
        for key in up:
            objects.needs_upload(txn, key)
        for key in rep.object_orphans:
            if not store.catalog.referenced(txn, key):
                objects.orphaned(txn, key)

    store.env.write(fn)
    uploaded = objects.retry_pending()
    if up:
        rep.repaired.append(f"uploaded {uploaded} of {len(up)} chunks missing from the object store")
    if rep.object_orphans:
        rep.repaired.append(f"listed {len(rep.object_orphans)} unused objects for deletion after the grace")


def _repair(store: KVStore, rep: CheckReport, docs: dict[str, DocumentRecord], wanted: set[tuple[str, str]],
            corrupt: set[str], stored: set[str]) -> None:
    catalog, blobs = store.catalog, store.blobs

    def fix_lmdb(txn: lmdb.Transaction) -> int:
        if rep.ref_drift:
            catalog.rewrite_refs(txn, wanted)
        dropped = 0
        for key in [*rep.orphans, *sorted(corrupt)]:
            # an orphan claimed since the check (a document now refers to it) stays
            if (key in corrupt or not catalog.referenced(txn, key)) and blobs.drop(txn, key):
                dropped += 1
        blobs.recount(txn)
        return dropped

    dropped = store.env.write(fix_lmdb)
    store.chunks.evict([*rep.orphans, *corrupt])
    if store.objects is not None and (rep.object_missing or rep.object_orphans):
        _repair_objects(store, rep, stored)
    if rep.ref_drift:
        rep.repaired.append(f"rewrote {len(wanted)} chunk refs from the documents")
    if dropped:
        rep.repaired.append(f"deleted {dropped} orphan or corrupt blobs")
    lost: dict[str, int] = {}
    for doc_id, _ in rep.missing:
        lost[doc_id] = lost.get(doc_id, 0) + 1
    for d in docs.values():
        if d.status == "ready":
            n = sum(k in corrupt for k in d.chunk_keys)
            if n:
                lost[d.id] = lost.get(d.id, 0) + n
    for doc_id, n in sorted(lost.items()):
        store.set_status(
            doc_id, "failed",
            error=f"{KV_LOST}: {n} chunk KV blobs missing or corrupt; re-ingest it from the stored text",
        )
        rep.repaired.append(f"marked document {doc_id!r} failed ({n} blobs lost)")
    if store.catalog.mirror is not None:  # the embedded index is the LMDB records just fixed
        counts = store.rebuild_index()
        rep.repaired.append(f"rebuilt the {counts['index']} index ({counts['documents']} documents)")
