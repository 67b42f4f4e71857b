"""`kvfuse bench store`: write and read throughput of chunk KV blobs, per KV format at rest.

For each format: encode (cast or quantize) + store N chunks (one LMDB transaction each, fsync'd as in
service), then read them back: from disk (the LMDB file's pages evicted from the OS page cache first),
cold (not in the hot tier, but in the page cache: LMDB memory map -> checksum -> one copy into tensors),
cold and then every layer made floats as the engine's loader makes them (`ChunkKV.layer_kv` to fp32: a
cast, or the dequantization), and hot (RAM tier); and copy the same bytes with a plain memcpy in the
same run. Then the reads a query makes, every chunk at once through `KVStore.load_chunks` on 1, 2, 4, ...
threads (`store.read_threads`), the hot tier off: cold (the file's pages evicted first, so the bytes come
from the disk) and warm (in the page cache). "Cold" is per file (posix_fadvise DONTNEED on the LMDB file,
not the whole host's cache, which other processes share); where the platform cannot, it is reported as
None.

Rates are in GB/s of the format's own bytes and in tokens per second (what a format changes: fewer
bytes per token), each format's also as a ratio to float16's in the same run (`vs_float16`). `scale`
says what a corpus costs at rest: GiB per million tokens per format for the default model and for an 8B
model's shape (Llama-3.1-8B: 32 layers, 8 KV heads, head_dim 128), from a blob of each encoded here.

"hot read" includes copying k and v out of the hot tier into fresh memory: `load_chunk` itself hands
out the shared tensors with no copy at all (reported as hot lookup), so the copy is what a caller that
needs its own buffer pays, and it is what is compared with memcpy. Both copy the same way: a numpy copy
(one plain memcpy); the torch clone variants are reported too (torch runs large copies on its intra-op
thread pool, which is slow on a busy host with few cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The default model (SmolLM2-135M-Instruct): 30 layers, 3 KV heads, head_dim 64 (docs: DESIGN.md).
DEFAULT_SHAPE = (30, 3, 64)
LLAMA_8B_SHAPE = (32, 8, 128)  # Llama-3.1-8B: the shape `scale` reports beside the default model's
DTYPES = ("float16", "bfloat16", "float32", "fp8", "int8", "int4")


def _parts(t: Any) -> list:
    """The tensors of a chunk's k or v: itself, or a quantized one's codes and scales."""
    return t.parts() if hasattr(t, "parts") else [t]


def _np_copy(t: Any) -> Any:
    """A plain single-threaded memcpy of a tensor's bytes (numpy; any dtype via a uint8 view)."""
    import torch

    return [p.view(torch.uint8).numpy().copy() for p in _parts(t)]


def _floats(k: Any, v: Any) -> None:
    """Every layer of a chunk made floats as the engine's loader makes them (`ChunkKV.layer_kv` in fp32)."""
    import torch

    from kvfuse.fusion.types import ChunkKV

    c = ChunkKV([0] * k.shape[2], k, v)
    for layer in range(k.shape[0]):
        c.layer_kv(layer, "cpu", torch.float32)


def _tokens_per_s(tokens: int, times: list[float]) -> float:
    return round(tokens / statistics.median(times)) if times and statistics.median(times) > 0 else float("inf")


def _evict_file_cache(path: Path) -> bool:
    """Drop one file's pages from the OS page cache (only this file: the host is shared); False where
    the platform cannot. The file must not be memory-mapped meanwhile (mapped pages stay)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else float("inf")


def _median_rate(nbytes: int, times: list[float]) -> float:
    return _gbps(nbytes, statistics.median(times))


def run_store_bench(
    settings: Any,
    *,
    json_out: bool,
    progress: bool,
    chunks: int = 16,
    tokens: int = 512,
    dtypes: tuple[str, ...] = DTYPES,
    repeats: int = 3,
    shape: tuple[int, int, int] = DEFAULT_SHAPE,
    scratch: Path | None = None,
    threads: tuple[int, ...] = (1, 2, 4),
    command: str | None = None,
) -> dict:
    """Run the benchmark in a scratch LMDB (removed afterwards); print JSON (json_out) or a table."""
    import torch
    from tqdm import tqdm

    from kvfuse.bench.store_report import compare, print_table, scale

    layers, kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(0)
    sources = [
        (torch.randn(layers, kv_heads, tokens, head_dim, generator=gen),
         torch.randn(layers, kv_heads, tokens, head_dim, generator=gen),
         torch.randint(0, 49152, (tokens,), generator=gen).tolist())
        for _ in range(chunks)
    ]
    steps = len(dtypes) * chunks * (1 + 5 * repeats)
    bar = tqdm(total=steps, desc="bench store", unit="chunk", file=sys.stderr, disable=not progress)
    results: dict[str, dict] = {}
    root = Path(tempfile.mkdtemp(prefix="kvfuse-bench-store-", dir=scratch))
    try:
        for dtype in dtypes:
            results[dtype] = _bench_dtype(settings, root, dtype, sources, shape, tokens, repeats, threads, bar, gen)
            shutil.rmtree(root / dtype, ignore_errors=True)
    finally:
        bar.close()
        shutil.rmtree(root, ignore_errors=True)

    compare(results)
    out = {
        "kind": "store",
        "command": command,
        "shape": {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim},
        "repeats": repeats,
        "verify_checksums": settings.store.verify_checksums,
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None},
        "goal": {"hot_read_gbps_min": 2.0, "hot_vs_memcpy_min": 0.5},
        "dtypes": results,
        "scale": scale(dtypes, {"default": shape, "llama-3.1-8b": LLAMA_8B_SHAPE}),
    }
    if json_out:
        print(json.dumps(out, indent=2))
    else:
        print_table(results, out["scale"])
    return out


def _threaded_reads(cfg: Any, keys: list[str], threads: int, repeats: int, nbytes: int) -> dict:
    """Every chunk read at once on `threads` threads, the hot tier off: cold (the LMDB file's pages
    evicted first) and warm (the same read again, from the page cache)."""
    from kvfuse.store.kvstore import KVStore

    cfg = cfg.model_copy(update={"store": cfg.store.model_copy(update={
        "hot_tier_mb": 0, "device_tier_mb": 0, "read_threads": threads})})
    cold, warm, evicted = [], [], True
    for _ in range(repeats):
        evicted = _evict_file_cache(cfg.lmdb_dir / "data.mdb") and evicted
        with KVStore.open(cfg) as store:
            t0 = time.perf_counter()
            got = store.load_chunks(keys)
            cold.append(time.perf_counter() - t0)
            if any(g is None or isinstance(g, Exception) for g in got):
                raise RuntimeError("a stored chunk did not read back")
            del got
            t0 = time.perf_counter()
            store.load_chunks(keys)
            warm.append(time.perf_counter() - t0)
    return {"threads": threads, "cold_read_gbps": _median_rate(nbytes, cold) if evicted else None,
            "warm_read_gbps": _median_rate(nbytes, warm)}


def _cli(args: argparse.Namespace) -> int:
    from kvfuse.bench.machine import command_line
    from kvfuse.config import get_settings

    out = run_store_bench(
        get_settings(),
        command=command_line("kvfuse bench store", args.parser, args),
        json_out=args.json,
        progress=not args.no_progress,
        chunks=args.chunks,
        tokens=args.tokens,
        dtypes=tuple(d.strip() for d in args.dtypes.split(",") if d.strip()),
        repeats=args.repeats,
        scratch=Path(args.dir) if args.dir else None,
        threads=tuple(int(t) for t in args.threads.split(",") if t.strip()),
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return 0


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    """Add `kvfuse bench store`; imports nothing heavy."""
    p = bench_subparsers.add_parser("store", help="KV blob write/read rates per KV format (512-token chunks)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--chunks", type=int, default=16, help="chunks per dtype")
    p.add_argument("--tokens", type=int, default=512, help="tokens per chunk")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated KV formats at rest")
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    p.add_argument("--repeats", type=int, default=3, help="read passes (the median is reported)")
    p.add_argument("--dir", default=None, help="scratch directory for the LMDB (default: system temp)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--threads", default="1,2,4", help="read thread counts for the query-shaped reads (cold and warm)")
    p.set_defaults(func=_cli, parser=p)


def _bench_dtype(settings: Any, root: Path, dtype: str, sources: list, shape: tuple[int, int, int], tokens: int,
                 repeats: int, threads: tuple[int, ...], bar: Any, gen: Any) -> dict:
    """One dtype's figures: write, cold (page cache evicted) and hot reads, memcpy of the same bytes, and
    threaded reads, in a scratch LMDB under `root`."""
    from kvfuse import kv_formats

    layers, kv_heads, head_dim = shape
    chunks = len(sources)
    payload = kv_formats.payload_bytes(dtype, (layers, kv_heads, tokens, head_dim))
    total_payload, total_tokens = payload * chunks, tokens * chunks
    cfg = settings.model_copy(update={
        "data_dir": root / dtype,
        "redis_url": "",  # the blob path is measured, not the index
        "store": settings.store.model_copy(update={
            "hot_tier_mb": (total_payload >> 20) + 64,  # every chunk fits: hot reads all hit
            "lmdb_map_size_mb": max(settings.store.lmdb_map_size_mb, (2 * total_payload >> 20) + 64),
        }),
    })
    keys, blob_bytes, t_encode, t_put = _write(cfg, dtype, sources, bar)
    disk, evicted = _disk_reads(cfg, keys, repeats, bar)
    cold, floats, lookup, hot, hot_torch, hot_stats = _tier_reads(cfg, keys, repeats, bar)
    memcpy, memcpy_torch = _memcpy(payload, chunks, repeats, bar, gen)
    by_threads = [_threaded_reads(cfg, keys, n, repeats, total_payload) for n in threads]
    bar.update(chunks)
    hot_gbps, memcpy_gbps = _median_rate(total_payload, hot), _median_rate(total_payload, memcpy)
    return {
        "chunks": chunks,
        "tokens_per_chunk": tokens,
        "blob_bytes": blob_bytes // chunks,
        "bytes_per_token": round(blob_bytes / chunks / tokens, 1),
        "payload_bytes_per_token": payload // tokens,
        "write_tokens_per_s": round(total_tokens / (t_encode + t_put)),
        "disk_read_tokens_per_s": _tokens_per_s(total_tokens, disk) if evicted else None,
        "cold_read_tokens_per_s": _tokens_per_s(total_tokens, cold),
        "cold_read_floats_tokens_per_s": _tokens_per_s(total_tokens, floats),
        "hot_read_tokens_per_s": _tokens_per_s(total_tokens, hot),
        "write_gbps": _gbps(blob_bytes, t_encode + t_put),
        "encode_gbps": _gbps(blob_bytes, t_encode),
        "lmdb_put_gbps": _gbps(blob_bytes, t_put),
        "cold_read_gbps": _median_rate(total_payload, cold),
        "disk_read_gbps": _median_rate(total_payload, disk) if evicted else None,
        "hot_read_gbps": hot_gbps,
        "hot_lookup_gbps": _median_rate(total_payload, lookup),
        "memcpy_gbps": memcpy_gbps,
        "hot_vs_memcpy": round(hot_gbps / memcpy_gbps, 3),
        "hot_read_torch_clone_gbps": _median_rate(total_payload, hot_torch),
        "memcpy_torch_clone_gbps": _median_rate(total_payload, memcpy_torch),
        "hot_hits": hot_stats["hot_hits"],
        "reads_by_threads": by_threads,
    }


def _write(cfg: Any, dtype: str, sources: list, bar: Any) -> tuple[list[str], int, float, float]:
    """Encode and store every chunk: (keys, blob bytes, encode seconds, LMDB put seconds)."""
    from kvfuse import kvblob
    from kvfuse.store.kvstore import KVStore

    keys, blob_bytes = [], 0
    with KVStore.open(cfg) as store:
        t_encode = t_put = 0.0
        for k, v, ids in sources:
            t0 = time.perf_counter()
            key = kvblob.chunk_key("bench-model", dtype, ids)
            blob = kvblob.encode(k, v, model_fingerprint="bench-model", token_ids=ids, dtype=dtype)
            t1 = time.perf_counter()
            store.put_chunk(key, blob)
            t_put += time.perf_counter() - t1
            t_encode += t1 - t0
            keys.append(key)
            blob_bytes += len(blob)
            bar.update()
    return keys, blob_bytes, t_encode, t_put


def _disk_reads(cfg: Any, keys: list[str], repeats: int, bar: Any) -> tuple[list[float], bool]:
    """Reads with nothing cached (the file's pages evicted before each pass): (seconds per pass, evicted)."""
    from kvfuse.store.kvstore import KVStore

    evicted = False
    disk = []
    for _ in range(repeats):
        evicted = _evict_file_cache(cfg.lmdb_dir / "data.mdb")
        with KVStore.open(cfg) as store:
            t0 = time.perf_counter()
            for key in keys:
                store.load_chunk(key)
            disk.append(time.perf_counter() - t0)
        bar.update(len(keys))
    return disk, evicted


def _tier_reads(cfg: Any, keys: list[str], repeats: int, bar: Any) -> tuple[list, list, list, list, list, dict]:
    """(cold: the hot tier cleared, cold and made floats layer by layer, lookup, hot with a numpy copy,
    hot with a torch clone, the hot tier's stats)."""
    from kvfuse.store.kvstore import KVStore

    chunks = len(keys)
    cold, floats, hot, hot_torch, lookup = [], [], [], [], []
    with KVStore.open(cfg) as store:
        for _ in range(repeats):
            store.hot.clear()
            t0 = time.perf_counter()
            for key in keys:
                store.load_chunk(key)
            cold.append(time.perf_counter() - t0)
            bar.update(chunks)

            store.hot.clear()
            t0 = time.perf_counter()
            for key in keys:
                k, v, _ = store.load_chunk(key)
                _floats(k, v)
            floats.append(time.perf_counter() - t0)
            bar.update(chunks)

            t0 = time.perf_counter()
            for key in keys:
                store.load_chunk(key)
            lookup.append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            for key in keys:
                k, v, _ = store.load_chunk(key)
                _np_copy(k)
                _np_copy(v)
            hot.append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            for key in keys:
                k, v, _ = store.load_chunk(key)
                for part in _parts(k) + _parts(v):
                    part.clone()
            hot_torch.append(time.perf_counter() - t0)
            bar.update(chunks)
        hot_stats = store.hot.stats()
    return cold, floats, lookup, hot, hot_torch, hot_stats


def _memcpy(payload: int, chunks: int, repeats: int, bar: Any, gen: Any) -> tuple[list[float], list[float]]:
    """memcpy of the same bytes in the same pieces (k-sized, v-sized), from bytearray-backed memory as in
    the hot tier: (numpy copy seconds, torch clone seconds) per pass."""
    import torch

    memcpy, memcpy_torch = [], []
    bufs = [torch.frombuffer(bytearray(payload // 2), dtype=torch.uint8).random_(generator=gen)
            for _ in range(2 * chunks)]
    for _ in range(repeats):
        t0 = time.perf_counter()
        for b in bufs:
            _np_copy(b)
        memcpy.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for b in bufs:
            b.clone()
        memcpy_torch.append(time.perf_counter() - t0)
        bar.update(chunks)
    return memcpy, memcpy_torch
