"""The worker's chunk KV, in the role of a block manager: content keys, precompute-and-store at ingestion,
loads for a query (rebuilt from the tokens on a miss, a damaged blob or another model's KV, or where
reading it would be slower than computing it: reload_policy.py), samkv's block-by-block sources, and the
system prompt's KV kept decoded.

The engine loop (core.py) and the per-job state (sequences.py) both use it; it knows neither.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

from kvfuse.config import Settings
from kvfuse.service.worker import reload_policy as policy

log = logging.getLogger("kvfuse.worker")

_PREFIX_CACHE_ENTRIES = 8  # distinct system prompts kept decoded in the worker
_UNREAD = object()  # load_or_rebuild reads the chunk itself
_PROBE_TOKENS = 128  # the precompute timed at start (token ids 10..137: any ids the vocabulary has)


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
        # the last `load_all`: chunks served per tier (and device bytes), and "source:<decision>:<reason>"
        # counts of the reload-or-recompute plan
        self.last_reads: dict[str, int] = {}
        self._prefixes: OrderedDict[str, Any] = OrderedDict()
        self.rates = policy.Rates(settings.store.reload_ewma_weight)
        self.reload_policy = settings.store.reload_policy
        if self.reload_policy:
            store.chunks.observer = self.rates.observe_read
            self.measure()

    def measure(self) -> dict[str, float | None]:
        """The policy's rates at start: one read from every storage tier that holds something, and one
        timed precompute (after an untimed one that warms the engine up)."""
        for tier in self.store.chunks.stores:
            got = tier.probe_read()
            if got is not None:
                self.rates.observe_read(tier.name, *got)
        ids = list(range(10, 10 + _PROBE_TOKENS))
        self.engine.precompute([ids])
        self._precompute([ids])
        log.info("reload-or-recompute rates at start: %s", self.rates.snapshot())
        return self.rates.snapshot()

    def _precompute(self, chunks: list[list[int]]) -> list[Any]:
        """engine.precompute, its throughput observed (chunk tokens per second)."""
        t0 = time.perf_counter()
        out = self.engine.precompute(chunks)
        self.rates.observe_precompute(sum(map(len, chunks)), time.perf_counter() - t0)
        return out

    def stored_nbytes(self, num_tokens: int) -> int:
        """Payload size at rest of a chunk of `num_tokens` (for a chunk already stored), scales included."""
        from kvfuse.kv_formats import payload_bytes

        e = self.engine
        return payload_bytes(self.kv_dtype, (e.num_layers, e.num_kv_heads, num_tokens, e.head_dim))

    def key_of(self, token_ids: list[int], context: list[int] | None = None) -> str:
        from kvfuse import kvblob

        return kvblob.chunk_key(self.engine.fingerprint, self.kv_dtype, token_ids, context or ())

    def compute_and_store(self, chunks: list[list[int]], contexts: list[list[int]] | None = None
                          ) -> list[tuple[str, int]]:
        """Precompute, encode and store chunks, each after its context if given (chunks alone are
        batched); returns (key, blob bytes) each."""
        fp, contexts = self.engine.fingerprint, contexts or [[] for _ in chunks]
        alone = [i for i, c in enumerate(contexts) if not c]
        computed = dict(zip(alone, self._precompute([chunks[i] for i in alone]), strict=True))
        for i, context in enumerate(contexts):
            if context:
                t0 = time.perf_counter()
                computed[i] = self.engine.precompute_after(context, chunks[i])
                self.rates.observe_precompute(len(context) + len(chunks[i]), time.perf_counter() - t0)
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

    def plan(self, chunks: list[tuple[str, list[int]]]) -> list[policy.Choice]:
        """Each chunk read or recomputed (reload_policy.plan over the tier it is in, its stored bytes and
        its tokens); every chunk read when the policy is off."""
        if not self.reload_policy:
            return [policy.Choice(policy.READ, "policy_off") for _ in chunks]
        where = self.store.chunks.where
        return policy.plan([policy.Chunk(where(key), self.stored_nbytes(len(ids)), len(ids)) for key, ids in chunks],
                           self.rates)

    def load_all(self, chunks: list[tuple[str, list[int]]]) -> list[tuple[Any, bool]]:
        """`load_or_rebuild` (no write-back of a miss) of every (key, token ids) the plan reads, the blobs
        read on the store's thread pool first (KVStore.load_chunks); the chunks a slow tier would take
        longer to read than to compute are computed from their tokens instead, alone, as a miss is (True:
        rebuilt). `last_reads` says which tier served them and how the plan chose (the worker loads one
        query at a time, so the counters' difference is this query's)."""
        before = dict(self.store.chunks.hits)
        with self.store.pinned([key for key, _ in chunks]):  # planned reads are not evicted under the plan
            choices = self.plan(chunks)
            slow = [i for i, c in enumerate(choices) if c.reason == policy.SLOWER]
            read = [i for i in range(len(chunks)) if i not in set(slow)]
            reads = self.store.load_chunks([chunks[i][0] for i in read])
        self.last_reads = {tier: n - before.get(tier, 0) for tier, n in self.store.chunks.hits.items()}
        self.last_reads |= {f"source:{k}": n for k, n in policy.counts(choices).items()}
        if self.store.device_tier is not None:
            self.last_reads["device_bytes"] = self.store.device_tier.stats()["device_bytes"]
        self.last_reads |= self.store.tier_levels()
        out: list[Any] = [None] * len(chunks)
        for i, got in zip(read, reads, strict=True):
            out[i] = self.load_or_rebuild(*chunks[i], write_back=False, read=got)
        if slow:
            for i, ckv in zip(slow, self._precompute([chunks[i][1] for i in slow]), strict=True):
                out[i] = (ckv, True)
            self.rebuilt += len(slow)
        return out

    def load_or_rebuild(self, key: str, token_ids: list[int], *, write_back: bool,
                        read: Any = _UNREAD) -> tuple[Any, bool]:
        """A chunk's ChunkKV from the store; recomputed from its token ids on a miss or a corrupt blob.

        A miss is not written back by default: the owning document may have been deleted meanwhile, and
        an unreferenced blob would leak. A corrupt blob is replaced (its document still refers to it).
        A chunk keyed with a precompute context is rebuilt alone (the query does not carry the context)
        and never written back: the alone cache is a fallback, not what its key names. A chunk the LMDB
        budget evicted is stored again (KVStore.readmit_kv: only while a document still uses it)."""
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
        ckv = self._precompute([token_ids])[0]
        self.rebuilt += 1
        if key != self.key_of(token_ids):
            return ckv, True
        if corrupt or write_back or self.share_rebuilt:
            self.store.put_kv(self.engine.fingerprint, self.kv_dtype, token_ids, ckv.k, ckv.v)
        else:  # one the LMDB budget evicted comes back in (the policy's second chance)
            self.store.readmit_kv(self.engine.fingerprint, self.kv_dtype, token_ids, ckv.k, ckv.v)
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
