"""KVStore: the one object the service opens; it wires the store's parts together and adds nothing.

  chunks   chunk_store.TieredStore: [the device tier over] the RAM hot tier over the LMDB blob tier (where
           chunk KV is read from), over the shared Redis tier on a fleet worker (shared_tier.py), over
           the object store when `object_store.url` is set (object_tier.py); a query's chunks are read
           on a thread pool (`load_chunks`)
  catalog  catalog.DocumentCatalog: document records, texts, chunk refs, the index (embedded or Redis)
  env      lmdb_env.LmdbEnv: the LMDB environment both keep their data in (the source of truth)

The tensors `load_chunk` returns are shared with the hot tier: callers treat them as read-only (the
fusion engine copies them into its own cache anyway).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import Any

import lmdb
from torch import Tensor

from kvfuse import kvblob
from kvfuse.config import Settings
from kvfuse.kvblob import ChunkEntry
from kvfuse.store.catalog import DocumentCatalog
from kvfuse.store.chunk_store import ChunkStore, TieredStore
from kvfuse.store.hot_tier import HotTier
from kvfuse.store.index import DocumentIndex, EmbeddedIndex
from kvfuse.store.jobs import JobStore
from kvfuse.store.lmdb_budget import LmdbBudget
from kvfuse.store.lmdb_env import LmdbEnv
from kvfuse.store.lmdb_tier import LmdbTier
from kvfuse.store.object_tier import ObjectTier
from kvfuse.store.records import DocumentRecord


class KVStore:
    def __init__(self, settings: Settings, env: LmdbEnv, index: DocumentIndex, *, require_index: bool = True,
                 shared: ChunkStore | None = None, keep_blobs: bool = True,
                 objects: ObjectTier | None = None) -> None:
        s = settings.store
        self.settings = settings
        self.env = env
        self.hot = HotTier(s.hot_tier_mb << 20)
        # KV on the model's device (GPU memory on a CUDA worker): a hit needs no copy to the device at all
        self.device_tier = (HotTier(s.device_tier_mb << 20, device=settings.model.device, name="device")
                            if s.device_tier_mb > 0 and keep_blobs else None)
        self._readers: ThreadPoolExecutor | None = None
        if keep_blobs:
            budget = LmdbBudget(s.lmdb_budget_mb << 20, s.eviction_policy) if s.lmdb_budget_mb > 0 else None
            self.blobs = LmdbTier(env, verify=s.verify_checksums, pin=settings.model.device.startswith("cuda"),
                                  budget=budget)
        else:  # a fleet's API: the blobs live on the workers (remote_blobs.py)
            from kvfuse.store.remote_blobs import RemoteBlobs

            self.blobs = RemoteBlobs(env, verify=s.verify_checksums, shared=shared)
        self.shared = shared
        self.objects = objects
        # A fleet worker reads down to the shared tier (shared_tier.py), and any host to the object store
        # (object_tier.py), before rebuilding a chunk. A fleet's API reads no chunk: its object tier only
        # deletes the objects no document uses.
        caches = (self.hot,) if self.device_tier is None else (self.device_tier, self.hot)
        self.caches: tuple[HotTier, ...] = caches  # the TieredStore's caches, by their own class
        lower = [t for t in (shared, objects) if t is not None] if keep_blobs else []
        self.chunks = TieredStore(*caches, self.blobs, *lower, caches=len(caches))
        self.catalog = DocumentCatalog(
            env, self.blobs, index, forget=self.chunks.evict, rebuild_on_empty=s.rebuild_index_on_empty,
            require_index=require_index, unreferenced=None if objects is None else objects.orphaned,
        )
        self.jobs = JobStore(env, self.catalog)
        if objects is not None:
            objects.local_copy = lambda key: LmdbTier.get(self.blobs, key)
            self.catalog.in_objects = objects.contains
            objects.in_use = lambda txn, key: (self.catalog.referenced(txn, key)
                                               or LmdbTier.stored(self.blobs, txn, key))
            if isinstance(self.blobs, LmdbTier):  # the budget never evicts a chunk not yet uploaded
                self.blobs.keep = objects.is_pending
            objects.start()

    @classmethod
    def open(cls, settings: Settings, *, readonly: bool = False, require_index: bool = True,
             shared: ChunkStore | None = None, keep_blobs: bool = True) -> KVStore:
        """Open the store. With require_index=False a Redis index that is down does not fail the open
        (the model worker, which reads blobs from LMDB, must not wait for it); it is checked at first use.
        `shared`: the shared tier of a fleet (shared_tier.RedisTier); `keep_blobs=False`: the store of a
        fleet's API, which keeps document records only (remote_blobs.py)."""
        s = settings.store
        env = LmdbEnv(settings.lmdb_dir, map_size=s.lmdb_map_size_mb << 20, max_readers=s.lmdb_max_readers,
                      readonly=readonly)
        try:
            if settings.redis_url:
                from kvfuse.store.redis_access import RedisAccess
                from kvfuse.store.redis_index import RedisIndex

                index: DocumentIndex = RedisIndex(RedisAccess.of(settings), s.redis_namespace)
            else:
                index = EmbeddedIndex(env)
            objects = None
            if settings.object_store.url:
                from kvfuse.store.s3_client import open_client

                objects = ObjectTier(open_client(settings.object_store), env, verify=s.verify_checksums,
                                     retry_s=settings.object_store.write_retry_s, grace_s=s.orphan_grace_s)
            return cls(settings, env, index, require_index=require_index, shared=shared, keep_blobs=keep_blobs,
                       objects=objects)
        except BaseException:
            env.close()
            raise

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._readers is not None:
            self._readers.shutdown(wait=True)
        self.chunks.close()
        if self.objects is not None:
            self.objects.close()
        for cache in self.caches:
            cache.clear()
        self.catalog.close()
        self.env.close()

    # --- chunks
    def put_chunk(self, key: str, blob: bytes) -> bool:
        """Store a blob under its content key; False if a valid copy is already there."""
        entry = kvblob.decode(blob)  # checksummed; views of `blob`, packed again by the blob tier
        added = self.chunks.put(key, entry)
        if added:
            self.catalog.chunk_stored(key)
        return added

    def put_kv(
        self, fingerprint: str, kv_dtype: str, token_ids: Sequence[int], k: Tensor, v: Tensor,
        artifacts: dict[str, Tensor] | None = None, context_ids: Sequence[int] = (),
    ) -> tuple[str, int]:
        """Encode a chunk's freshly computed KV (cast to `kv_dtype` at rest) and its optional artifacts, key
        it by content (and the context it was computed after, if any) and store it; returns (key, blob
        bytes). Stored once: an identical chunk already there is kept."""
        key = kvblob.chunk_key(fingerprint, kv_dtype, token_ids, context_ids)
        blob = kvblob.encode(k, v, model_fingerprint=fingerprint, token_ids=token_ids, dtype=kv_dtype,
                             artifacts=artifacts, context_ids=context_ids)
        self.put_chunk(key, blob)
        return key, len(blob)

    def put_kv_referenced(self, rows: Sequence[tuple[str, bytes]]) -> list[str]:
        """Store blobs (key, blob) computed at a query or a warm-up, but only those a document or a running
        ingestion still refers to, checked in the write's own transaction (a chunk of a document deleted
        meanwhile is not written: it would be an orphan). Returns the keys written."""
        for key, blob in rows:
            if kvblob.read_header(blob).key != key:
                raise ValueError(f"blob belongs under key {kvblob.read_header(blob).key}, not {key}")

        def fn(txn: lmdb.Transaction) -> list[str]:
            return [key for key, blob in rows if self.catalog.referenced(txn, key)
                    and self.blobs.write(txn, key, blob, kvblob.read_header(blob).num_tokens)]

        added = self.env.write(fn)
        self.chunks.evict(added)  # no cache holds an older copy
        for key in added:
            self.catalog.chunk_stored(key)
        return added

    def has_chunk(self, key: str) -> bool:
        """Whether LMDB holds the blob. Not the hot tier: another process may have deleted the blob while
        this one still holds it decoded (content-addressed, so still right to serve, but not stored)."""
        return self.blobs.contains(key)

    def has_or_fetch(self, key: str) -> bool:
        """`has_chunk`, or else the chunk copied into LMDB from the object store when that holds it (a
        valid copy: its checksums verified): ingestion then stores it without computing it again."""
        if self.has_chunk(key):
            return True
        if self.objects is None:
            return False
        try:
            entry = self.objects.get(key)
        except kvblob.CorruptBlobError:
            return False
        if entry is None:
            return False
        self.blobs.put(key, entry)
        self.catalog.chunk_stored(key)
        return True

    def load_chunk(self, key: str) -> ChunkEntry | None:
        """(k, v, header) from the first tier that has it (kvfuse.store.chunk_store); None = miss. Raises
        CorruptBlobError (rebuild it from the chunk's token ids)."""
        return self.chunks.get(key)

    def load_chunks(self, keys: Sequence[str]) -> list[ChunkEntry | None | kvblob.CorruptBlobError]:
        """`load_chunk` of every key, read on `store.read_threads` threads (the copy out of the memory map
        and its checksum release the GIL, so reads from LMDB overlap): per key its entry, None (a miss)
        or the CorruptBlobError its read raised, in order."""
        def read(key: str) -> ChunkEntry | None | kvblob.CorruptBlobError:
            try:
                return self.chunks.get(key)
            except kvblob.CorruptBlobError as err:
                return err

        threads = self.settings.store.read_threads
        if threads <= 1 or len(keys) <= 1:
            return [read(k) for k in keys]
        if self._readers is None:
            self._readers = ThreadPoolExecutor(threads, thread_name_prefix="kvfuse-read")
        return list(self._readers.map(read, keys))

    @contextmanager
    def pinned(self, keys: Sequence[str]) -> Iterator[None]:
        """Keep these chunks from being evicted by the LMDB budget while the block runs (a query reading
        them; store/lmdb_budget.py)."""
        budget = getattr(self.blobs, "budget", None)
        with budget.pinned(keys) if budget is not None else nullcontext():
            yield

    def stored_chunks(self, keys: Sequence[str]) -> int:
        """How many of `keys` the blob tier holds (a first-use document's chunks with KV so far)."""
        with self.env.read() as txn:
            return sum(self.blobs.stored(txn, k) for k in keys)

    def blob_fingerprint(self, key: str) -> str | None:
        """The model fingerprint in a stored blob's header (None if the blob is not stored or unreadable)."""
        return self.blobs.fingerprint(key)

    # --- the model the stored KV is for (`kvfuse store check` compares blob headers with it)
    def model_fingerprint(self) -> str:
        """The fingerprint of the model the service last ran with ("" if none ever did)."""
        with self.env.read() as txn:
            raw = txn.get(b"model_fingerprint", db=self.env.db("meta"))
            return "" if raw is None else bytes(raw).decode()

    def set_model_fingerprint(self, fingerprint: str) -> None:
        if fingerprint != self.model_fingerprint():
            self.env.write(lambda txn: txn.put(b"model_fingerprint", fingerprint.encode(), db=self.env.db("meta")))

    def load_blocks(self, key: str, blocks: list[int]) -> tuple[ChunkEntry, int] | None:
        """((k, v, header) of the tokens of `blocks` only, bytes read from storage); None = miss. Raises
        CorruptBlobError."""
        return self.chunks.get_blocks(key, blocks)

    def load_artifacts(self, key: str) -> kvblob.KVHeader | None:
        """The chunk's header with its artifacts (`header.artifacts` None: a version-1 blob); None = miss."""
        return self.chunks.get_artifacts(key)

    # --- documents (kvfuse.store.catalog)
    def put_document(self, doc: DocumentRecord, text: str | None = None) -> None:
        self.catalog.put_document(doc, text)

    def set_status(self, doc_id: str, status: str, *, error: str | None = None, **fields: Any) -> None:
        self.catalog.set_status(doc_id, status, error=error, **fields)

    def get_document(self, doc_id: str) -> DocumentRecord | None:
        return self.catalog.get_document(doc_id)

    def get_text(self, doc_id: str) -> str | None:
        return self.catalog.get_text(doc_id)

    def list_documents(self, *, offset: int = 0, limit: int = 50,
                       collection: str | None = None) -> tuple[list[DocumentRecord], int]:
        return self.catalog.list_documents(offset=offset, limit=limit, collection=collection)

    def delete_document(self, doc_id: str) -> bool:
        return self.catalog.delete_document(doc_id)

    def rebuild_index(self) -> dict[str, int | str]:
        return self.catalog.rebuild_index()

    def tier_levels(self) -> dict[str, int]:
        """Per tier, the bytes it holds and its evictions so far (`bytes:<tier>`, `evictions:<tier>`; the
        kvfuse_kv_tier_bytes / _evictions_total metrics). The shared tier's are the whole fleet's."""
        out: dict[str, int] = {}
        for cache in self.caches:
            st = cache.stats()
            out[f"bytes:{cache.name}"], out[f"evictions:{cache.name}"] = st[f"{cache.name}_bytes"], st[f"{cache.name}_evictions"]
        with self.env.read() as txn:
            out["bytes:lmdb"] = self.blobs.kv_bytes(txn)
        out["evictions:lmdb"] = self.blobs.budget.evictions if self.blobs.budget is not None else 0
        if self.shared is not None and hasattr(self.shared, "used_bytes") and hasattr(self.shared, "evictions"):
            try:
                out[f"bytes:{self.shared.name}"] = self.shared.used_bytes()
                out[f"evictions:{self.shared.name}"] = self.shared.evictions()
            except Exception:  # noqa: BLE001 - a probe: an unreachable shared tier reports nothing
                pass
        return out

    # --- housekeeping
    def stats(self) -> dict[str, int | str]:
        with self.env.read() as txn:
            out: dict[str, int | str] = {
                "documents": self.catalog.count(txn),
                "chunks": self.blobs.count(txn),
                "kv_bytes": self.blobs.kv_bytes(txn),
            }
        if self.blobs.budget is not None:
            out |= self.blobs.budget.stats()
        out |= {"index": self.catalog.index.kind}
        out |= self.env.sizes()
        for cache in self.caches:
            out |= cache.stats()
        if self.objects is not None:
            out |= self.objects.stats()
        return out | {f"tier_hits_{k}": v for k, v in self.chunks.hits.items()}
