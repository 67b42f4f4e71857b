"""What an ingestion step of `kvfuse bench overload`'s flood is made of, beside a query's decode step
(docs/results/overload/README.md, "What limits it").

The flood's documents are one chunk of about 15 tokens; on the shared 2-core machine an engine step that
precomputes one took 4.75 to 8.7 s, two to three times a query's step. This times, in one worker
(WorkerCore, the bench server's settings: 64-token chunks, a 1024-token context), N times each: the
chunk's forward alone (ChunkCache.compute), its blob written to the store alone (KVStore.put_kv: encode,
LMDB with sync, the Redis index), the whole ingestion step (Step.seconds of a PrecomputeJob of one new
chunk), and the decode steps of a 4-token query over two stored 64-token chunks. Run with the worker's
torch threads as the first argument (0: torch's default, 2 here; 1: one thread), in its own process:

    PYTHONPATH=. python studies/ingest_step_parts.py 0 8 > /tmp/parts-default.json
    PYTHONPATH=. python studies/ingest_step_parts.py 1 8 > /tmp/parts-one.json
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path


def main(threads: int, n: int) -> dict:
    import redis

    from kvfuse.config import load_settings
    from kvfuse.service.wire import protocol as P
    from kvfuse.service.worker.core import WorkerCore

    root = Path(tempfile.mkdtemp(prefix="ingest-parts-"))
    namespace = f"kvfuse-study-{uuid.uuid4().hex[:12]}"
    url = os.environ.get("KVFUSE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
    settings = load_settings(data_dir=root / "data", model_cache_dir=Path("data/models").resolve(),
                             log_level="warning", redis_url=url, store={"redis_namespace": namespace},
                             model={"max_context_tokens": 1024, "threads": threads})
    sent: list = []
    w = WorkerCore(settings, sent.append)
    try:
        return _measure(w, sent, P, n) | {"threads": threads, "torch_threads": _torch_threads(),
                                          "load_avg_1m": os.getloadavg()[0]}
    finally:
        w.store.close()
        client = redis.Redis.from_url(url)
        for key in client.scan_iter(match=f"{namespace}:*", count=1000):
            client.delete(key)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _drive(w, sent: list, *msgs) -> list:
    sent.clear()
    for m in msgs:
        w.receive(m)
    while w.has_work:
        w.step()
    return list(sent)


def _measure(w, sent: list, P, n: int) -> dict:
    kv = w.kv
    fresh = iter(range(1000, 10**6, 17))

    def chunk(length: int) -> list[int]:
        return [next(fresh) % 30000 + 100 for _ in range(length)]

    times: dict[str, list[float]] = {"forward_s": [], "store_s": [], "ingest_step_s": [], "decode_step_s": []}
    for _ in range(n):
        ids = chunk(15)
        t = time.perf_counter()
        computed = kv.compute([ids], [[]])[0]
        times["forward_s"].append(time.perf_counter() - t)
        t = time.perf_counter()
        kv.store.put_kv(w.engine.fingerprint, kv.kv_dtype, ids, computed.k, computed.v, None)
        times["store_s"].append(time.perf_counter() - t)
        steps = [m for m in _drive(w, sent, P.PrecomputeJob(chunks=[chunk(15)], job_id=next(fresh)))
                 if isinstance(m, P.Step)]
        times["ingest_step_s"] += [s.seconds for s in steps]
    context = [chunk(64), chunk(64)]
    done = next(m for m in _drive(w, sent, P.PrecomputeJob(chunks=context, job_id=1)) if isinstance(m, P.Done))
    for i in range(max(1, n // 4)):
        job = P.QueryJob(question="What did the author make a list of?", system_prompt=None, explicit=True,
                         fusion={"method": "anchor", "recompute_ratio": 0.15},
                         generation={"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop": []},
                         chunks=[P.ChunkRef(k, c, 1.0) for k, c in zip(done.keys, context, strict=True)])
        job.job_id = 100 + i
        steps = [m for m in _drive(w, sent, job) if isinstance(m, P.Step)]
        times["decode_step_s"] += [s.seconds for s in steps if s.batch_size]
    return {k: {"n": len(v), "median": round(statistics.median(v), 4), "mean": round(statistics.fmean(v), 4)}
            for k, v in times.items() if v}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 8), indent=1))
