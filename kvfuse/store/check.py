"""`kvfuse store check [--repair]`: compare everything the store holds with what its documents need.

Finds: orphan blobs (no document refers to them), missing blobs and corrupt blobs (checksum, or stored
under a key that is not their own) of `ready` documents, chunk refs that disagree with the documents,
the kv_bytes counter, and index/LMDB drift.

Repair: rewrites the refs from the documents, deletes orphans older than `store.orphan_grace_s` (a
younger one may belong to an ingest that has not written its document yet) and corrupt blobs, marks each
`ready` document with a missing or corrupt blob `failed` with an error starting with `kv_lost` (its
chunk keys and text are kept: the service re-ingests it from the stored text), recounts kv_bytes and
rebuilds the index from LMDB.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import lmdb

from kvfuse.kvblob import CorruptBlobError, verify_blob
from kvfuse.store.index import lmdb_snapshot
from kvfuse.store.kvstore import KVStore
from kvfuse.store.records import KV_LOST, ChunkInfo, DocumentRecord


@dataclass
class CheckReport:
    documents: int = 0
    chunks: int = 0
    orphans: list[str] = field(default_factory=list)  # old enough to delete
    young_orphans: list[str] = field(default_factory=list)  # within the grace period: left alone
    missing: list[tuple[str, str]] = field(default_factory=list)  # (doc id, chunk key)
    corrupt: list[tuple[str, str]] = field(default_factory=list)  # (chunk key, reason)
    ref_drift: int = 0  # refs entries to add or remove
    kv_bytes_drift: int = 0  # counter minus the real sum
    index_drift: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)

    @property
    def problems(self) -> int:
        return (
            len(self.orphans) + len(self.missing) + len(self.corrupt) + self.ref_drift
            + bool(self.kv_bytes_drift) + len(self.index_drift)
        )

    def to_dict(self) -> dict:
        return asdict(self) | {"problems": self.problems}


def _index_drift(store: KVStore) -> list[str]:
    truth, mirror = lmdb_snapshot(store.tier), store.index.snapshot()
    drift = []
    for doc_id in sorted(truth.docs.keys() ^ mirror.docs.keys()):
        where = "LMDB" if doc_id in truth.docs else "the index"
        drift.append(f"document {doc_id!r} only in {where}")
    drift += [f"document {d!r} differs" for d in sorted(truth.docs.keys() & mirror.docs.keys())
              if truth.docs[d] != mirror.docs[d]]
    drift += [f"chunk {k} only in LMDB" for k in sorted(truth.chunks - mirror.chunks)]
    drift += [f"chunk {k} only in the index" for k in sorted(mirror.chunks - truth.chunks)]
    drift += [f"owners of chunk {k} differ" for k in sorted(truth.owners.keys() | mirror.owners.keys())
              if truth.owners.get(k) != mirror.owners.get(k)]
    return drift


def check_store(store: KVStore, *, repair: bool = False, grace_s: float | None = None) -> CheckReport:
    grace = store.settings.store.orphan_grace_s if grace_s is None else grace_s
    db = store.tier.db
    rep = CheckReport()
    now = time.time()
    with store.tier.read() as txn:
        docs = {bytes(k).decode(): DocumentRecord.from_json(v) for k, v in txn.cursor(db=db("docs"))}
        wanted = {(k, d.id) for d in docs.values() for k in d.chunk_keys}
        refs = {(bytes(k).decode(), bytes(v).decode()) for k, v in txn.cursor(db=db("refs"))}
        referenced = {k for k, _ in wanted}
        stored: set[str] = set()
        real_bytes = 0
        for kb, blob in txn.cursor(db=db("chunks")):
            key = bytes(kb).decode()
            stored.add(key)
            real_bytes += len(blob)
            try:
                header = verify_blob(blob)
                if header.key != key:
                    raise CorruptBlobError(f"stored under {key} but belongs under {header.key}")
            except CorruptBlobError as err:
                rep.corrupt.append((key, str(err)))
            if key not in referenced:
                raw = txn.get(kb, db=db("chunkinfo"))
                created = ChunkInfo.from_json(key, raw).created_at if raw is not None else 0.0
                (rep.young_orphans if now - created < grace else rep.orphans).append(key)
        raw = txn.get(b"kv_bytes", db=db("meta"))
        rep.kv_bytes_drift = (int(bytes(raw)) if raw is not None else 0) - real_bytes
    rep.documents, rep.chunks = len(docs), len(stored)
    rep.ref_drift = len(wanted ^ refs)
    corrupt = {k for k, _ in rep.corrupt}
    rep.missing = sorted(
        (d.id, k) for d in docs.values() if d.status == "ready" for k in d.chunk_keys if k not in stored
    )
    rep.index_drift = _index_drift(store)
    if repair and rep.problems:
        _repair(store, rep, docs, wanted, corrupt)
    return rep


def _repair(
    store: KVStore, rep: CheckReport, docs: dict[str, DocumentRecord], wanted: set[tuple[str, str]], corrupt: set[str]
) -> None:
    db = store.tier.db

    def fix_lmdb(txn: lmdb.Transaction) -> tuple[int, int]:
        if rep.ref_drift:
            txn.drop(db("refs"), delete=False)
            for key, doc_id in sorted(wanted):
                txn.put(key.encode(), doc_id.encode(), db=db("refs"), dupdata=True)
        dropped = 0
        for key in [*rep.orphans, *sorted(corrupt)]:
            kb = key.encode()
            if (key in corrupt or txn.get(kb, db=db("refs")) is None) and store._drop_chunk(txn, kb):
                dropped += 1
        stale_infos = [bytes(k) for k in txn.cursor(db=db("chunkinfo")).iternext(values=False)
                       if txn.get(bytes(k), db=db("chunks")) is None]
        for k in stale_infos:
            txn.delete(k, db=db("chunkinfo"))
        total = sum(len(v) for _, v in txn.cursor(db=db("chunks")))
        txn.put(b"kv_bytes", str(total).encode(), db=db("meta"))
        return dropped, total

    dropped, _ = store.tier.write(fix_lmdb)
    for key in [*rep.orphans, *corrupt]:
        store.hot.discard(key)
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
    if store.index.kind != "embedded":  # the embedded index is the LMDB records just fixed
        counts = store.rebuild_index()
        rep.repaired.append(f"rebuilt the {counts['index']} index ({counts['documents']} documents)")
