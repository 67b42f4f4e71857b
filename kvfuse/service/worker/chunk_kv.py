"""The worker's chunk KV, in the role of a block manager: content keys, precompute-and-store at ingestion,
loads for a query (rebuilt from the tokens on a miss, a damaged blob or another model's KV), samkv's
block-by-block sources, and the system prompt's KV kept decoded.

The engine loop (core.py) and the per-job state (sequences.py) both use it; it knows neither.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from kvfuse.config import Settings

log = logging.getLogger("kvfuse.worker")

_PREFIX_CACHE_ENTRIES = 8  # distinct system prompts kept decoded in the worker
_UNREAD = object()  # load_or_rebuild reads the chunk itself


class ChunkCache:
    """Chunk KV for one engine over one store. `share_rebuilt`: a chunk rebuilt on a miss is written back
    to the store (a fleet's chunk is every host's), instead of only a corrupt one."""

    def __init__(self, engine: Any, store: Any, settings: Settings, *, share_rebuilt: bool = False) -> None:
        self.engine = engine
        self.store = store
        self.settings = settings
        self.kv_dtype = settings.store.kv_dtype
        self.share_rebuilt = share_rebuilt
        self.rebuilt = 0  # chunks rebuilt from their tokens since start
        self.last_reads: dict[str, int] = {}  # the last `load_all`: chunks served per tier (and device bytes)
        self._prefixes: OrderedDict[str, Any] = OrderedDict()

    def stored_nbytes(self, num_tokens: int) -> int:
        """Payload size at rest of a chunk of `num_tokens` (for a chunk already stored)."""
        from kvfuse import kvblob

        e = self.engine
        return 2 * e.num_layers * e.num_kv_heads * num_tokens * e.head_dim * kvblob.dtype_size(self.kv_dtype)

    def key_of(self, token_ids: list[int], context: list[int] | None = None) -> str:
        from kvfuse import kvblob

        return kvblob.chunk_key(self.engine.fingerprint, self.kv_dtype, token_ids, context or ())

    def compute_and_store(self, chunks: list[list[int]], contexts: list[list[int]] | None = None
                          ) -> list[tuple[str, int]]:
        """Precompute, encode and store chunks, each after its context if given (chunks alone are
        batched); returns (key, blob bytes) each."""
        fp, contexts = self.engine.fingerprint, contexts or [[] for _ in chunks]
        alone = [i for i, c in enumerate(contexts) if not c]
        computed = dict(zip(alone, self.engine.precompute([chunks[i] for i in alone]), strict=True))
        for i, context in enumerate(contexts):
            if context:
                computed[i] = self.engine.precompute_after(context, chunks[i])
        return [self.store.put_kv(fp, self.kv_dtype, chunks[i], computed[i].k, computed[i].v,
                                  self.chunk_artifacts(chunks[i]), context_ids=contexts[i])
                for i in range(len(chunks))]

    def chunk_artifacts(self, token_ids: list[int]) -> dict | None:
        """What the blob keeps beside the KV: samkv's analysis of the chunk (kvfuse.fusion.methods.sparse), when
        `fusion.samkv_ingest_artifacts` is on; else None (samkv rebuilds it on demand)."""
        if not self.settings.fusion.samkv_ingest_artifacts:
            return None
        from kvfuse.fusion.methods.sparse import artifacts

        return artifacts.build(self.engine.tf, token_ids).to_tensors()

    def block_source(self, key: str, token_ids: list[int]) -> Any:
        """A chunk read block by block from the store (samkv); the whole chunk, rebuilt if need be, on a
        miss or a damaged blob."""
        from kvfuse.fusion.methods.sparse.source import StoreSource

        return StoreSource(self.store, key, token_ids,
                           fallback=lambda: self.load_or_rebuild(key, token_ids, write_back=False)[0])

    def load_all(self, chunks: list[tuple[str, list[int]]]) -> list[tuple[Any, bool]]:
        """`load_or_rebuild` (no write-back of a miss) of every (key, token ids), the blobs read on the
        store's thread pool first (KVStore.load_chunks); `last_reads` says which tier served them (the
        worker loads one query at a time, so the counters' difference is this query's)."""
        before = dict(self.store.chunks.hits)
        reads = self.store.load_chunks([key for key, _ in chunks])
        self.last_reads = {tier: n - before.get(tier, 0) for tier, n in self.store.chunks.hits.items()}
        if self.store.device_tier is not None:
            self.last_reads["device_bytes"] = self.store.device_tier.stats()["device_bytes"]
        return [self.load_or_rebuild(key, ids, write_back=False, read=got)
                for (key, ids), got in zip(chunks, reads, strict=True)]

    def load_or_rebuild(self, key: str, token_ids: list[int], *, write_back: bool,
                        read: Any = _UNREAD) -> tuple[Any, bool]:
        """A chunk's ChunkKV from the store; recomputed from its token ids on a miss or a corrupt blob.

        A miss is not written back by default: the owning document may have been deleted meanwhile, and
        an unreferenced blob would leak. A corrupt blob is replaced (its document still refers to it).
        A chunk keyed with a precompute context is rebuilt alone (the query does not carry the context)
        and never written back: the alone cache is a fallback, not what its key names."""
        from kvfuse import kvblob
        from kvfuse.fusion import ChunkKV

        corrupt = False
        try:
            hit = self.store.load_chunk(key) if read is _UNREAD else read  # `read`: load_all's read of it
            if isinstance(hit, kvblob.CorruptBlobError):
                raise hit
        except kvblob.CorruptBlobError as err:
            log.warning("chunk %s is corrupt (%s): rebuilding it from its tokens", key[:16], err)
            hit, corrupt = None, True
        if hit is not None and hit[2].model_fingerprint != self.engine.fingerprint:
            # Another model's KV (a key from elsewhere): a miss, never fused; rebuilt from the tokens.
            log.warning("chunk %s holds KV of another model: rebuilding it from its tokens", key[:16])
            hit = None
        if hit is not None:
            k, v, header = hit
            if header.num_tokens == len(token_ids) and header.token_hash == kvblob.token_hash(token_ids):
                return ChunkKV(token_ids=token_ids, k=k, v=v, after_context=bool(header.context_hash)), False
            log.warning("chunk %s does not match its tokens: rebuilding it", key[:16])
            corrupt = True
        ckv = self.engine.precompute([token_ids])[0]
        self.rebuilt += 1
        if (corrupt or write_back or self.share_rebuilt) and key == self.key_of(token_ids):
            self.store.put_kv(self.engine.fingerprint, self.kv_dtype, token_ids, ckv.k, ckv.v)
        return ckv, True

    def prefix_kv(self, prefix_ids: list[int]) -> Any:
        """The system prompt's KV, cached by content like any chunk (kept decoded in this process)."""
        key = self.key_of(prefix_ids)
        if key in self._prefixes:
            self._prefixes.move_to_end(key)
            return self._prefixes[key]
        ckv = self.engine.precompute([prefix_ids])[0]
        self._prefixes[key] = ckv
        while len(self._prefixes) > _PREFIX_CACHE_ENTRIES:
            self._prefixes.popitem(last=False)
        return ckv
