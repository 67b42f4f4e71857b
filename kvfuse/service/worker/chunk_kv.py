"""The worker's chunk KV, in the role of a block manager: content keys, precompute-and-store at ingestion,
loads for a query (computed on a miss, a damaged blob or another model's KV, or where reading it would be
slower than computing it: reload_policy.py), samkv's block-by-block sources; the system prompts' KV kept
decoded is prefix_cache.py's.

A chunk a query finds in no tier (never computed, under `store.precompute_at: first_use`, or evicted) is
computed within the query's load, with the query's other such chunks, after the context its record names
(the query carries it: ChunkRef.context), so it is the KV eager ingestion computes, bit for bit: the same
function over the same tokens. It is then written back, so the next query reads it; in an embedded store
only while a document still refers to it (checked in the write's own transaction: a chunk of a document
deleted meanwhile would be an orphan). See docs/DESIGN.md, "KV when it pays".

The engine loop (core.py) and the per-job state (sequences.py) both use it; it knows neither.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from kvfuse.config import Settings
from kvfuse.fusion.engine.ledger import Ledger, transient
from kvfuse.fusion.steps import drain, timed
from kvfuse.service.worker import reload_policy as policy
from kvfuse.service.worker.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from kvfuse.kvblob import ChunkEntry, CorruptBlobError

log = logging.getLogger("kvfuse.worker")

_UNREAD = object()  # load_or_rebuild reads the chunk itself
Wanted = tuple  # (key, token ids) or (key, token ids, context: list[int] | None) of a chunk a query loads
_PROBE_TOKENS = 128  # the precompute timed at start (token ids 10..137: any ids the vocabulary has)
# reload_policy counts: a chunk in no tier computed after its recorded context and kept; one whose
# context is not known (a record from before contexts were recorded) computed alone and not kept
FIRST_USE = "first_use"


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
        self.last_computed: dict[str, float] = {}  # the last `load_all`: chunks computed and read, seconds
        self.prefixes = PrefixCache(engine, self.key_of)  # the system prompts' KV, kept decoded
        self._ledger: Ledger | None = None  # the engine core's, where loads are held (`hold_in`)
        self.rates = policy.Rates(settings.store.reload_ewma_weight, settings.store.reload_probe_every)
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
        return drain(self._observed(self.engine.precompute_steps(chunks, paused=False), sum(map(len, chunks))))

    def _observed(self, steps: Generator[None, None, list[Any]], tokens: int) -> Generator[None, None, list[Any]]:
        """`yield from`: a precompute's chunk caches, its throughput observed over the time it ran, not
        the engine steps that ran while it was paused between layers."""
        got, seconds = yield from timed(steps)
        if tokens:
            self.rates.observe_precompute(tokens, seconds)
        return got

    def stored_nbytes(self, num_tokens: int) -> int:
        """Payload size at rest of a chunk of `num_tokens` (for a chunk already stored), scales included."""
        from kvfuse.kv_formats import payload_bytes

        e = self.engine
        return payload_bytes(self.kv_dtype, (e.num_layers, e.num_kv_heads, num_tokens, e.head_dim))

    def key_of(self, token_ids: list[int], context: list[int] | None = None) -> str:
        from kvfuse import kvblob

        return kvblob.chunk_key(self.engine.fingerprint, self.kv_dtype, token_ids, context or ())

    def compute(self, chunks: list[list[int]], contexts: list[list[int]]) -> list[Any]:
        """Each chunk's ChunkKV after its context: chunks alone batched, each with a context one prefill of
        context + chunk. Ingestion and a query's cold chunks both compute this way, so a chunk computed at
        first use is the chunk ingestion would have stored, bit for bit. With `store.precompute_runs` the
        chunks with a context go in runs (`context_runs`: a chunk whose context is another's context + that
        chunk, consecutive chunks of a document while the budget reaches its start), one prefill of context
        + chunks each (`precompute_run`): fewer tokens, the same KV to rounding only (docs/DESIGN.md, "KV
        when it pays")."""
        return drain(self.compute_steps(chunks, contexts, paused=False))

    def compute_steps(self, chunks: list[list[int]], contexts: list[list[int]], *, paused: bool = True
                      ) -> Generator[None, None, list[Any]]:
        """`compute`, yielding after every decoder layer of its forwards but each one's last (`paused`:
        an ingestion piece cut by layer, FusionEngine.precompute_steps): the same KV either way."""
        e = self.engine
        alone = [i for i, c in enumerate(contexts) if not c]
        got = yield from self._observed(e.precompute_steps([chunks[i] for i in alone], paused=paused),
                                        sum(len(chunks[i]) for i in alone))
        computed = dict(zip(alone, got, strict=True))
        for run in self._runs(chunks, contexts):
            got = yield from self._observed(
                e.precompute_run_steps(contexts[run[0]], [chunks[i] for i in run], paused=paused),
                len(contexts[run[0]]) + sum(len(chunks[i]) for i in run))
            computed.update(zip(run, got, strict=True))
        return [computed[i] for i in range(len(chunks))]

    def _runs(self, chunks: list[list[int]], contexts: list[list[int]]) -> list[list[int]]:
        """The chunks with a context, in the prefills `compute` runs them in (`context_runs`, or one each)."""
        if self.settings.store.precompute_runs:
            return context_runs(chunks, contexts)
        return [[i] for i, c in enumerate(contexts) if c]

    def compute_peak(self, chunks: list[list[int]], contexts: list[list[int]]) -> int:
        """The most KV tokens `compute` holds on the model's device: its largest forward's cache (the chunks
        alone in padded batches, or one context run) beside every chunk computed before it is at rest."""
        alone = [len(c) for c, ctx in zip(chunks, contexts, strict=True) if not ctx]
        forwards = [_batch_peak(alone, self.engine.precompute_batch_tokens)]
        forwards += [len(contexts[run[0]]) + sum(len(chunks[i]) for i in run) for run in self._runs(chunks, contexts)]
        return max(forwards) + sum(map(len, chunks))

    def compute_and_store(self, chunks: list[list[int]], contexts: list[list[int]] | None = None, *,
                          referenced_only: bool = False) -> list[tuple[str, int]]:
        """Precompute, encode and store chunks, each after its context if given (chunks alone are
        batched); returns (key, blob bytes) each. `referenced_only`: only those a document refers to are
        written (KVStore.put_kv_referenced; the others are left out of the answer)."""
        return drain(self.compute_and_store_steps(chunks, contexts, referenced_only=referenced_only, paused=False))

    def compute_and_store_steps(self, chunks: list[list[int]], contexts: list[list[int]] | None = None, *,
                                referenced_only: bool = False, paused: bool = True
                                ) -> Generator[None, None, list[tuple[str, int]]]:
        """`compute_and_store`, its forwards yielding between decoder layers (`compute_steps`)."""
        fp, contexts = self.engine.fingerprint, contexts or [[] for _ in chunks]
        computed = yield from self.compute_steps(chunks, contexts, paused=paused)
        if referenced_only:
            rows = [(self.key_of(chunks[i], contexts[i]), self._at_rest(chunks[i], contexts[i], computed[i])[0])
                    for i in range(len(chunks))]
            added = set(self.store.put_kv_referenced(rows))
            return [(key, len(blob)) for key, blob in rows if key in added]
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

    def block_sources(self, chunks: list[Wanted]) -> list[Any]:
        """samkv's chunks: each one a tier holds read block by block from the store (`block_source`); those
        in no tier computed now, within the query's load (`load_all`: counted in the ledger, a load without
        the room waiting for it, and kept), so samkv's prefill finds them in memory. `last_reads` and
        `last_computed` say so, as `load_all` does."""
        wanted = [_wanted(c) for c in chunks]
        cold = self.cold(wanted)
        got = self.load_all([wanted[i] for i in cold]) if cold else []
        if not cold:
            self.last_reads, self.last_computed = {}, {"computed_tokens": 0, "compute_s": 0.0}
        self.last_computed |= {"chunks_computed": len(cold), "chunks_read": len(wanted) - len(cold)}  # the rest by block
        computed = {i: ckv for i, (ckv, _) in zip(cold, got, strict=True)}
        return [computed[i] if i in computed else self.block_source(*w) for i, w in enumerate(wanted)]

    def block_source(self, key: str, token_ids: list[int], context: list[int] | None = None) -> Any:
        """A chunk read block by block from the store (samkv); the whole chunk, computed after its context
        if need be, on a miss or a damaged blob (a chunk evicted or damaged after its load found it:
        `load_or_rebuild`, its forward counted in the ledger during the prefill that meets it)."""
        from kvfuse.fusion.methods.sparse.source import StoreSource

        return StoreSource(self.store, key, token_ids,
                           fallback=lambda: self.load_or_rebuild(key, token_ids, context=context)[0])

    def plan(self, chunks: list[Wanted]) -> list[policy.Choice]:
        """Each chunk read or recomputed (reload_policy.plan over the tier it is in, its bytes there in the
        KV format it was stored in, and the tokens computing it takes: its own and its context's); every
        chunk read when the policy is off."""
        if not self.reload_policy:
            return [policy.Choice(policy.READ, "policy_off") for _ in chunks]
        out = []
        for key, ids, context in map(_wanted, chunks):
            tier, nbytes = self.store.chunks.locate(key)
            out.append(policy.Chunk(tier, self.stored_nbytes(len(ids)) if nbytes is None else nbytes,
                                    len(ids) + len(context or ())))
        return policy.plan(out, self.rates, parallel=self.settings.store.read_threads)

    def cold(self, chunks: list[Wanted]) -> list[int]:
        """The indices of the chunks no tier holds (what a query would compute: chunk_kv's first use)."""
        return [i for i, (key, _, _) in enumerate(map(_wanted, chunks)) if self.store.chunks.locate(key)[0] is None]

    def compute_and_keep(self, chunks: list[Wanted]) -> int:
        """Compute chunks a query found in no tier, after their recorded contexts, and keep them (`_keep`), as
        `load_all` does for the cold chunks it computes: for a query answered by a full prefill instead
        (reload_policy.full_prefill_first), afterwards at ingestion's share. A chunk a tier holds by now
        (another query kept it) is skipped. Returns the chunks computed."""
        return drain(self.compute_and_keep_steps(chunks, paused=False))

    def compute_and_keep_steps(self, chunks: list[Wanted], *, paused: bool = True) -> Generator[None, None, int]:
        """`compute_and_keep`, its forwards yielding between decoder layers (`compute_steps`)."""
        wanted = [w for w in map(_wanted, chunks) if w[2] is not None and self.store.chunks.locate(w[0])[0] is None]
        if not wanted:
            return 0
        computed = yield from self.compute_steps([ids for _, ids, _ in wanted], [ctx or [] for _, _, ctx in wanted],
                                                 paused=paused)
        self._keep([(key, ids, ctx, self._at_rest(ids, ctx or [], ckv)[0])
                    for (key, ids, ctx), ckv in zip(wanted, computed, strict=True)])
        self.rebuilt += len(wanted)
        return len(wanted)

    def load_all(self, chunks: list[Wanted]) -> list[tuple[Any, bool]]:
        """The ChunkKV of every (key, token ids[, context]) and whether it was computed here. The plan's
        reads go to the store's thread pool at once (KVStore.load_chunks); the chunks a slow tier would
        take longer to read than to compute, and those found in no tier (or damaged, or another model's),
        are computed together after their contexts (`compute`), and those found in no tier kept (`_keep`).
        `last_reads` says which tier served them and how the plan chose, `last_computed` how many were
        computed and in how long (the worker loads one query at a time, so the counters' difference is
        this query's)."""
        wanted = [_wanted(c) for c in chunks]
        before = dict(self.store.chunks.hits)
        with ExitStack() as room:
            with self.store.pinned([w[0] for w in wanted]):  # planned reads are not evicted under the plan
                choices = self.plan(wanted)
                slow = [i for i, c in enumerate(choices) if c.reason == policy.SLOWER]
                # the room for what is computed whatever the reads find, before any read: a load that must
                # wait for it (NeedsRoom) has read nothing it would read again
                known = self._room(room, wanted, slow + [i for i, c in enumerate(choices) if c.reason == policy.MISS])
                read = [i for i in range(len(wanted)) if i not in set(slow)]
                reads = self.store.load_chunks([wanted[i][0] for i in read])
            self.last_reads = {tier: n - before.get(tier, 0) for tier, n in self.store.chunks.hits.items()}
            out: list[Any] = [None] * len(wanted)
            cold = []
            for i, got in zip(read, reads, strict=True):
                ckv = self._decoded(*wanted[i][:2], got)
                if ckv is None:
                    cold.append(i)
                    choices[i] = policy.Choice(policy.RECOMPUTE, policy.MISS if wanted[i][2] is None else FIRST_USE)
                else:
                    out[i] = (ckv, False)
            t0 = time.perf_counter()
            todo = slow + cold
            if todo:
                self._room(room, wanted, todo, beyond=known)  # what a damaged or foreign blob adds
                ids, contexts = [wanted[i][1] for i in todo], [wanted[i][2] or [] for i in todo]
                blobs = {}  # each computed chunk at rest (`_at_rest` reads it back from its blob) frees its device copy
                for i, ckv in zip(todo, self.compute(ids, contexts), strict=True):
                    blobs[i], stored = self._at_rest(wanted[i][1], wanted[i][2] or [], ckv)
                    out[i] = (stored, True)
                self.rebuilt += len(todo)
        if todo:
            self._keep([(wanted[i][0], wanted[i][1], wanted[i][2], blobs[i]) for i in cold])
        self.last_computed = {"chunks_computed": len(todo), "chunks_read": len(wanted) - len(todo),
                              "computed_tokens": sum(len(wanted[i][1]) for i in todo),
                              "compute_s": time.perf_counter() - t0}
        self.last_reads |= {f"source:{k}": n for k, n in policy.counts(choices).items()}
        if self.store.device_tier is not None:
            self.last_reads["device_bytes"] = self.store.device_tier.stats()["device_bytes"]
        self.last_reads |= self.store.tier_levels()
        return out

    def _room(self, stack: ExitStack, wanted: list[tuple[str, list[int], list[int] | None]], computed: list[int],
              beyond: int = 0) -> int:
        """Hold in the ledger, until `stack` closes, the KV tokens computing the chunks `computed` takes
        (`compute_peak`) beyond the `beyond` already held (`ledger.transient`: NeedsRoom without it);
        returns their peak."""
        peak = self.compute_peak([wanted[i][1] for i in computed], [wanted[i][2] or [] for i in computed])
        stack.enter_context(transient(self._ledger, peak - beyond, f"computing {len(computed)} chunks"))
        return peak

    def _decoded(self, key: str, token_ids: list[int], hit: ChunkEntry | CorruptBlobError | None) -> Any:
        """A read's ChunkKV; None where it must be computed instead: a miss, a damaged blob, another model's
        KV (a key from elsewhere: never fused) or a blob that does not match the chunk's tokens."""
        from kvfuse import kvblob
        from kvfuse.fusion import ChunkKV

        if isinstance(hit, kvblob.CorruptBlobError):
            log.warning("chunk %s is corrupt (%s): computing it again", key[:16], hit)
            return None
        if hit is None:
            return None
        k, v, header = hit
        if header.model_fingerprint != self.engine.fingerprint:
            log.warning("chunk %s holds KV of another model: computing it again", key[:16])
            return None
        if header.num_tokens != len(token_ids) or header.token_hash != kvblob.token_hash(token_ids):
            log.warning("chunk %s does not match its tokens: computing it again", key[:16])
            return None
        return ChunkKV(token_ids=token_ids, k=k, v=v, after_context=bool(header.context_hash))

    def _at_rest(self, token_ids: list[int], context: list[int], ckv: Any) -> tuple[bytes, Any]:
        """A computed chunk's blob in `store.kv_dtype`, and its ChunkKV as a read of that blob gives it (a
        quantized format's codes and scales): what the query fuses is what the next query will read, so
        an answer over a chunk computed at first use is the answer over it stored (eager ingestion's)."""
        from kvfuse import kvblob

        blob = kvblob.encode(ckv.k, ckv.v, model_fingerprint=self.engine.fingerprint, token_ids=token_ids,
                             dtype=self.kv_dtype, artifacts=self.chunk_artifacts(token_ids), context_ids=context)
        return blob, self._decoded("", token_ids, kvblob.decode(blob, verify=False, copy=True))

    def _keep(self, computed: list[tuple[str, list[int], list[int] | None, bytes]]) -> None:
        """Write chunks computed on a miss back under their keys: on a fleet worker (`share_rebuilt`) each
        (a fleet's chunk is every host's); in an embedded store only those a document (or a running
        ingestion) still refers to, checked in the write's transaction (KVStore.put_kv_referenced), so a
        document deleted meanwhile leaves no orphan. Never one whose context is not known, nor one whose
        key names another KV format: what was computed is not what that key names."""
        rows = [(key, blob) for key, ids, ctx, blob in computed if ctx is not None and key == self.key_of(ids, ctx)]
        if self.share_rebuilt:
            for key, blob in rows:
                self.store.put_chunk(key, blob)
        elif rows:
            self.store.put_kv_referenced(rows)

    def load_or_rebuild(self, key: str, token_ids: list[int], *, read: Any = _UNREAD,
                        context: list[int] | None = None) -> tuple[Any, bool]:
        """A chunk's ChunkKV from the store; computed after `context` on a miss or a damaged blob (True:
        computed), and then always kept as `load_all` keeps a chunk found in no tier (`_keep`: only while a
        document uses it, within the LMDB budget). `context` None: not known; the chunk is computed alone
        and kept only if its key is that of the chunk alone."""
        from kvfuse import kvblob

        try:
            hit = self.store.load_chunk(key) if read is _UNREAD else read  # `read`: load_all's read of it
        except kvblob.CorruptBlobError as err:
            hit = err
        ckv = self._decoded(key, token_ids, hit)
        if ckv is not None:
            return ckv, False
        peak = self.compute_peak([token_ids], [context or []])
        with transient(self._ledger, peak, "computing a chunk no tier holds"):
            blob, ckv = self._at_rest(token_ids, context or [], self.compute([token_ids], [context or []])[0])
        self.rebuilt += 1
        known = context if context is not None else ([] if key == self.key_of(token_ids) else None)
        # a damaged copy is replaced, a missing or evicted one comes back in: put_kv_referenced stores it
        # only while a document still uses it, within the budget (docs/DESIGN.md, "Bounded tiers")
        self._keep([(key, token_ids, known, blob)])
        return ckv, True

    def hold_in(self, ledger: Ledger) -> None:
        """Count in `ledger` (the engine core's, the worker's one device ledger: kvfuse/fusion/engine/
        ledger.py) from now on a query's load while it runs (`ledger.transient`: its cold chunks' forwards)
        and the prefix cache's entries and forwards (prefix_cache.py)."""
        self._ledger = ledger
        self.prefixes.hold_in(ledger)


def _batch_peak(lengths: list[int], batch_tokens: int) -> int:
    """The most KV tokens one batched forward of chunks alone holds (the model's own cache, FusionEngine.
    precompute): a batch is padded to its longest chunk, at most `batch_tokens` unless one chunk is longer."""
    return min(len(lengths) * max(lengths), max(batch_tokens, max(lengths))) if lengths else 0


def _wanted(chunk: Wanted) -> tuple[str, list[int], list[int] | None]:
    """(key, token ids, context) of a chunk to load; a pair's context is [] (alone)."""
    return (chunk[0], chunk[1], chunk[2]) if len(chunk) > 2 else (chunk[0], chunk[1], [])


def context_runs(chunks: list[list[int]], contexts: list[list[int]]) -> list[list[int]]:
    """The chunks with a context (indices) in runs one prefill computes exactly: each run's chunks in
    order, every one's context the first's context followed by the run's chunks before it, so in one
    causal pass each sits after exactly its own context at its own positions. Chunks alone are left out."""
    runs: list[list[int]] = []
    ends: dict[tuple[int, ...], int] = {}  # a run's tokens so far (context + its chunks) -> the run
    for i in sorted((i for i, c in enumerate(contexts) if c), key=lambda i: len(contexts[i])):
        at = ends.pop(tuple(contexts[i]), None)
        if at is None:
            at = len(runs)
            runs.append([])
        runs[at].append(i)
        ends[tuple(contexts[i]) + tuple(chunks[i])] = at
    return runs
