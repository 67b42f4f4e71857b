"""`kvfuse bench object-store`: S3 clients compared on chunk-sized objects, against the configured store.

For each client (kvfuse/store/s3_client.py) and object size: PUT `--objects` objects, then GET them all
in parallel on 1, 4, 16 ... threads (what one query's chunks cost: KVStore.load_chunks), measuring
throughput (MB/s of object bytes), this process's CPU seconds per GB read (user + system, from
getrusage: what the read costs the host beside the engine), and the latency of one GET of a small
object alone (the per-request cost the reload policy sees besides bandwidth), median and p90 of
`--latency-gets`. Every client reads the same objects under one prefix in the same run, in turn, and
each GET's bytes are checked against what was written. The objects are deleted at the end.

`--redis URL` adds Redis (the fleet's shared KV tier, shared_tier.py) as a third "client": the same
objects as plain GET/SET values under a key prefix of this run's own, so whether the Redis tier still
pays beneath or beside an object store is measured in the same run.

Run against any S3 API through the `object_store` settings (url, endpoint, credentials), e.g. a local
SeaweedFS: docs/results/object-store/README.md has the command.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _gets(client: Any, keys: list[str], threads: int, size: int) -> dict:
    def one(key: str) -> int:
        data = client.get(key)
        if data is None or len(data) != size:
            raise RuntimeError(f"{key}: read {None if data is None else len(data)} bytes, wrote {size}")
        return len(data)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, keys[:threads]))  # connections opened before the clock starts
        c0, t0 = _cpu(), time.perf_counter()
        total = sum(pool.map(one, keys))
        seconds, cpu = time.perf_counter() - t0, _cpu() - c0
    return {"threads": threads, "mb_per_s": total / seconds / 1e6, "cpu_s_per_gb": cpu / (total / 1e9),
            "seconds": seconds}


def _latency(client: Any, key: str, n: int) -> dict:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.get(key)
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"p50_ms": 1e3 * statistics.median(times), "p90_ms": 1e3 * times[int(0.9 * (len(times) - 1))]}


class RedisValues:
    """Redis as the bench's third client: values under `prefix:` (a pool as large as the most threads)."""

    def __init__(self, url: str, prefix: str, pool: int = 64) -> None:
        import redis

        self._r = redis.Redis.from_url(url, max_connections=pool)
        self._prefix = prefix

    def get(self, key: str) -> bytes | None:
        return self._r.get(f"{self._prefix}:{key}")

    def put(self, key: str, data: bytes) -> None:
        self._r.set(f"{self._prefix}:{key}", data)

    def delete(self, key: str) -> None:
        self._r.delete(f"{self._prefix}:{key}")


def run(cfg: Any, clients: list[str], sizes: list[int], objects: int, threads: list[int], latency_gets: int,
        repeats: int, redis_url: str = "") -> dict:
    from kvfuse.store.s3_client import open_client

    run_prefix = f"bench-{uuid.uuid4().hex[:8]}"
    cfg = cfg.model_copy(update={"url": cfg.url.rstrip("/") + "/" + run_prefix})
    opened: dict[str, Any] = {name: open_client(cfg, name) for name in clients}
    writer = opened[clients[0]]
    out: dict = {"url": cfg.url, "endpoint": cfg.endpoint, "objects": objects, "cpus": os.cpu_count(),
                 "clients": {}}
    written: list[str] = []
    try:
        for size in sizes:
            keys = [f"s{size}/{i:05d}" for i in range(objects)]
            payload = os.urandom(size)
            t0 = time.perf_counter()
            for k in keys:
                writer.put(k, payload)
            put_s = time.perf_counter() - t0
            written += keys
            small = f"s{size}/latency"
            writer.put(small, b"x" * 4096)
            written.append(small)
            readers = dict(opened)
            if redis_url:
                readers["redis"] = RedisValues(redis_url, f"kvfuse-bench:{run_prefix}")
                for k in [*keys, small]:
                    readers["redis"].put(k, payload if k != small else b"x" * 4096)
            try:
                for name, client in readers.items():
                    runs = {t: [_gets(client, keys, t, size) for _ in range(repeats)] for t in threads}
                    row = {t: min(r, key=lambda x: x["seconds"]) | {"mb_per_s_all": [x["mb_per_s"] for x in r]}
                           for t, r in runs.items()}
                    out["clients"].setdefault(name, {})[str(size)] = {
                        "gets": row, "latency_4k": _latency(client, small, latency_gets)}
            finally:
                if "redis" in readers:
                    for k in [*keys, small]:
                        readers["redis"].delete(k)
            out.setdefault("puts", {})[str(size)] = {"client": clients[0], "mb_per_s": size * objects / put_s / 1e6}
    finally:
        for k in written:
            writer.delete(k)
    return out


def table(result: dict) -> str:
    lines = ["| client | object | threads | GET MB/s | CPU s per GB | 4 KiB GET p50 / p90 ms |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, by_size in result["clients"].items():
        for size, r in by_size.items():
            lat = r["latency_4k"]
            for t, g in r["gets"].items():
                lines.append(f"| {name} | {int(size) / 1e6:.1f} MB | {t} | {g['mb_per_s']:.0f} | "
                             f"{g['cpu_s_per_gb']:.2f} | {lat['p50_ms']:.2f} / {lat['p90_ms']:.2f} |")
    return "\n".join(lines)


def _cli(args: argparse.Namespace) -> int:
    from kvfuse.config import get_settings

    cfg = get_settings().object_store
    if not cfg.url:
        print("object_store.url is not set (KVFUSE_OBJECT_STORE__URL=s3://bucket/prefix, and its endpoint)",
              file=sys.stderr)
        return 2
    result = run(cfg, args.clients.split(","), [int(s) for s in args.sizes.split(",")], args.objects,
                 [int(t) for t in args.threads.split(",")], args.latency_gets, args.repeats, args.redis)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1) if args.json else table(result))
    return 0


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    """Add `kvfuse bench object-store`; imports nothing heavy."""
    p = bench_subparsers.add_parser("object-store", help="S3 clients on chunk-sized objects (object_store.url)")
    p.add_argument("--clients", default="obstore,boto3", help="comma-separated: obstore, boto3")
    p.add_argument("--sizes", default="300000,3000000", help="object sizes in bytes (an int8 chunk of 256 "
                   "tokens of the default model is about 3 MB)")
    p.add_argument("--objects", type=int, default=64, help="objects per size")
    p.add_argument("--threads", default="1,4,16", help="parallel GETs")
    p.add_argument("--latency-gets", type=int, default=50, help="single GETs of a 4 KiB object timed")
    p.add_argument("--repeats", type=int, default=3, help="passes per thread count (the fastest is kept)")
    p.add_argument("--redis", default="", help="also read the same objects from this Redis URL (the fleet's "
                   "shared KV tier), as a baseline in the same run")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    p.set_defaults(func=_cli, parser=p)
