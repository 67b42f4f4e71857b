"""The speed benchmark: time to first token per method at growing context, with the chunk KV already
in memory ("warm") and read back from a real LMDB store ("cold"), plus KV load time, decode speed and
peak memory. Every figure is also given relative to vanilla from the same run.

"Cold" means: the chunk blobs were written with `KVStore.put_kv` into a `KVStore` in a temp
data dir with its RAM hot tier off, and each repeat reads and decodes them with `load_chunk` before
fusing. The OS page cache still holds the LMDB file (dropping it needs root), so this is the cost of
the store's read path, not of a cold disk. `samkv` reads its chunks block by block from the same
store inside its prefill (only the blocks it selects); its KV load time is those reads plus the prefix.

Beside TTFT: the share of the chunks' KV bytes each method reads (`kv_loaded_share`, and the bytes read
from the store in the cold runs, `kv_loaded_mb`) and the size of the fused cache it prefills and decodes
over (`fused_cache_tokens`, `fused_cache_mb` in the compute dtype).
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfuse.bench.engine_backend import EngineBackend, loaded_share_and_cache
from kvfuse.bench.fidelity import median, method_plan
from kvfuse.bench.memory import PeakRSS
from kvfuse.bench.tasks import Haystack, TaskConfig, synthetic
from kvfuse.fusion.engine import solo

SPEED_COLUMNS = (
    "method", "ratio", "context_tokens", "ttft_s_median", "ttft_vs_vanilla", "ttft_cold_s_median",
    "ttft_cold_vs_vanilla", "kv_load_s", "kv_load_vs_vanilla_ttft", "decode_tok_s", "decode_vs_vanilla",
    "peak_rss_mb", "peak_rss_vs_vanilla", "recomputed_tokens", "kv_loaded_share", "kv_loaded_mb",
    "fused_cache_tokens", "fused_cache_mb",
)


@dataclass
class Sample:
    ttft_s: float
    decode_tok_s: float | None
    peak_rss_mb: float
    recomputed_tokens: int
    kv_load_s: float = 0.0
    kv_loaded_share: float = 0.0  # of the chunks' KV bytes (see engine_backend.loaded_share_and_cache)
    kv_loaded_bytes: int | None = None  # what the prefill read from the store (cold runs of samkv)
    fused_cache_tokens: int = 0


def _generate(backend: EngineBackend, prefix: Any, chunks: Any, question_ids: Any, opts: Any) -> Sample:
    from kvfuse.fusion import GenerationResult

    result = None
    with PeakRSS() as mem:
        for item in solo.generate(backend.engine, prefix, chunks, question_ids, opts, backend.gen):
            if isinstance(item, GenerationResult):
                result = item
    assert result is not None, "generate() ended without a result"
    # forward steps after the first token over their time (a step that produced EOS counts: it was run)
    n_dec = result.decode_steps
    dec_s = float(result.timings.get("decode_s") or 0.0)
    share, cache_tokens = loaded_share_and_cache(opts.method, result.stats)
    return Sample(
        ttft_s=float(result.timings["ttft_s"]),
        decode_tok_s=n_dec / dec_s if n_dec > 0 and dec_s > 0 else None,
        peak_rss_mb=mem.delta_mb,
        recomputed_tokens=int(result.usage.get("recomputed_tokens", 0)),
        kv_load_s=float(result.timings.get("kv_load_s", 0.0)),  # reads inside the prefill (samkv's blocks)
        kv_loaded_share=share,
        kv_loaded_bytes=result.stats.get("kv_loaded_bytes"),
        fused_cache_tokens=cache_tokens,
    )


class ColdStore:
    """The example's chunk blobs in a real KVStore (temp data dir, embedded index, hot tier off)."""

    def __init__(self, backend: EngineBackend, chunks: list[Any], root: Path, artifacts: bool = False):
        """artifacts: store samkv's per-chunk artifacts with the chunks (not the prefix), as ingest does."""
        from kvfuse.store import KVStore

        s = backend.settings
        self.kv_dtype = s.store.kv_dtype
        settings = s.model_copy(update={
            "data_dir": root, "redis_url": "", "store": s.store.model_copy(update={"hot_tier_mb": 0}),
        })
        self.store = KVStore.open(settings)
        fp = backend.engine.fingerprint
        self.keys = []
        self.kv_bytes = 0
        for i, c in enumerate(chunks):
            arts = None
            if artifacts and i > 0:
                from kvfuse.fusion.methods.samkv import artifacts_for
                from kvfuse.fusion.methods.sparse.source import MemorySource

                arts = artifacts_for(backend.engine, MemorySource(c))[0].to_tensors()
            key, nbytes = self.store.put_kv(fp, self.kv_dtype, c.token_ids, c.k, c.v, arts)
            self.keys.append((key, c.token_ids))
            self.kv_bytes += nbytes
        # whether each was computed after a context (the blob here does not record it; the selection reads it)
        self.after_context = [c.after_context for c in chunks]
        self.chunk_payload_bytes = sum(self.store.load_artifacts(k).payload_bytes for k, _ in self.keys[1:])

    def load(self) -> list[Any]:
        from kvfuse.fusion import ChunkKV

        out = []
        for (key, token_ids), after in zip(self.keys, self.after_context, strict=True):
            got = self.store.load_chunk(key)
            if got is None:
                raise RuntimeError(f"chunk {key} missing from the store it was just written to")
            k, v, _header = got
            out.append(ChunkKV(token_ids=list(token_ids), k=k, v=v, after_context=after))
        return out

    def load_sparse(self) -> list[Any]:
        """The prefix read whole, the chunks as block sources (samkv reads the blocks it selects)."""
        from kvfuse.fusion import ChunkKV
        from kvfuse.fusion.methods.sparse.source import StoreSource

        (pkey, pids), *rest = self.keys
        k, v, _ = self.store.load_chunk(pkey)

        def missing() -> Any:
            raise RuntimeError("chunk missing from the store it was just written to")

        return [ChunkKV(list(pids), k, v)] + [StoreSource(self.store, key, list(ids), missing) for key, ids in rest]

    def close(self) -> None:
        self.store.close()


def _own_pipeline(method: str) -> bool:
    from kvfuse.fusion.methods import get_method

    return get_method(method).own_pipeline


def _cache_bytes_per_token(backend: EngineBackend) -> int:
    """K and V of one position over every layer, in the engine's compute dtype (the fused cache's)."""
    e = backend.engine
    return 2 * e.num_layers * e.num_kv_heads * e.head_dim * torch_itemsize(e.dtype)


def torch_itemsize(dtype: Any) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _cold_sample(backend: EngineBackend, store: ColdStore, sparse: bool, question_ids: Any,
                 opts: Any) -> Sample:
    """One generation from caches read back from disk; its TTFT is the load plus the prefill."""
    t0 = time.perf_counter()
    loaded = store.load_sparse() if sparse else store.load()
    load_s = time.perf_counter() - t0
    s = _generate(backend, loaded[0], loaded[1:], question_ids, opts)
    inner = s.kv_load_s  # samkv reads its blocks inside the prefill
    s.kv_load_s, s.ttft_s = load_s + inner, s.ttft_s - inner  # cold TTFT = sum
    if s.kv_loaded_bytes is None:
        s.kv_loaded_bytes = store.chunk_payload_bytes
    return s


def run_speed(
    backend: EngineBackend, hay: Haystack, *, contexts: list[int], methods: list[str], ratio: float,
    repeats: int, doc_tokens: int, seed: int, cold: bool = True,
    on_context: Callable[[list[dict[str, Any]], list[dict[str, Any]]], None] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows (one per method × context) and the raw samples; `on_context(rows, raw)` after each context
    (the CLI checkpoints its JSON there)."""
    from tqdm import tqdm

    plan = method_plan(methods, [ratio], floor=False)  # the floor is a fidelity measure, not a speed one
    warmed: set[str] = set()
    rows: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    bar = tqdm(total=len(contexts) * len(plan), file=sys.stderr, unit="method", dynamic_ncols=True)
    try:
        for ctx in contexts:
            cfg = TaskConfig(n=1, docs=max(1, round(ctx / doc_tokens)), doc_tokens=doc_tokens, seed=seed)
            ex = synthetic("needle", hay, cfg, 0)
            prefix, chunks, question_ids = backend.prepare(ex)
            n_ctx = sum(len(c.token_ids) for c in chunks)
            with tempfile.TemporaryDirectory(prefix="kvfuse-bench-") as tmp:
                sparse = {m for m, _ in plan if _own_pipeline(m)}
                store = ColdStore(backend, [prefix, *chunks], Path(tmp), artifacts=bool(sparse)) if cold else None
                per_method: dict[str, dict[str, Any]] = {}
                for method, r in plan:
                    bar.set_description(f"{ctx} tokens {method}")
                    opts = backend.options(method, r)
                    backend.ingest_artifacts(method, chunks)  # ingest-time work, not timed
                    if method not in warmed:  # first-call costs (allocator, kernels) once per method
                        _generate(backend, prefix, chunks, question_ids, opts)
                        warmed.add(method)
                    warm = [_generate(backend, prefix, chunks, question_ids, opts) for _ in range(repeats)]
                    cold_samples: list[Sample] = []
                    if store is not None and method == "vanilla":
                        cold_samples = warm  # vanilla prefills from tokens: it loads nothing, cold = warm
                    elif store is not None:
                        cold_samples = [_cold_sample(backend, store, method in sparse, question_ids, opts)
                                        for _ in range(repeats)]
                    if r is None:  # fixed by the method (epic): report the measured share
                        r = round(warm[0].recomputed_tokens / n_ctx, 3)
                    for mode, samples in (("warm", warm), ("cold", cold_samples if method != "vanilla" else [])):
                        raw += [{"method": method, "ratio": r, "context_tokens": n_ctx, "mode": mode,
                                 **s.__dict__} for s in samples]
                    per_method[method] = {
                        "method": method, "ratio": r, "context_tokens": n_ctx, "target_context_tokens": ctx,
                        "chunks": len(chunks),
                        "ttft_s_median": median([s.ttft_s for s in warm]),
                        "ttft_cold_s_median": median([s.kv_load_s + s.ttft_s for s in cold_samples]),
                        "kv_load_s": median([s.kv_load_s for s in cold_samples]),
                        "decode_tok_s": median([s.decode_tok_s for s in warm]),
                        "peak_rss_mb": max(s.peak_rss_mb for s in warm),
                        "peak_rss_cold_mb": max((s.peak_rss_mb for s in cold_samples), default=None),
                        "recomputed_tokens": warm[0].recomputed_tokens,
                        "kv_bytes": store.kv_bytes if store is not None else None,
                        "kv_loaded_share": warm[0].kv_loaded_share,
                        "kv_loaded_mb": (median([s.kv_loaded_bytes for s in cold_samples]) or 0) / 2**20
                        if cold_samples and method != "vanilla" else 0.0,
                        "fused_cache_tokens": warm[0].fused_cache_tokens,
                        "fused_cache_mb": warm[0].fused_cache_tokens * _cache_bytes_per_token(backend) / 2**20,
                    }
                    bar.update(1)
                if store is not None:
                    store.close()
            van = per_method["vanilla"]
            for row in per_method.values():
                row["ttft_vs_vanilla"] = _ratio(row["ttft_s_median"], van["ttft_s_median"])
                row["ttft_cold_vs_vanilla"] = _ratio(row["ttft_cold_s_median"], van["ttft_cold_s_median"])
                row["kv_load_vs_vanilla_ttft"] = _ratio(row["kv_load_s"], van["ttft_s_median"])
                row["decode_vs_vanilla"] = _ratio(row["decode_tok_s"], van["decode_tok_s"])
                row["peak_rss_vs_vanilla"] = _ratio(row["peak_rss_mb"], van["peak_rss_mb"])
                rows.append(row)
            if on_context is not None:
                on_context(rows, raw)
    finally:
        bar.close()
    return rows, raw
