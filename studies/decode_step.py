"""Time of one batched decode step against batch size and cache length.

Why: `kvfuse bench load` shows what batching buys end to end; this separates the step itself into what
every step pays once (reading the weights), what grows with the batch (the matmuls' rows) and what grows
with each sequence's cache (attention reads). The numbers are in docs/results/load.md.

    taskset -c 0 env OMP_NUM_THREADS=1 python studies/decode_step.py --threads 1 \
        --batches 1,2,4,8 --lengths 16,2048,4096 --json docs/results/decode-step.json
"""

import argparse
import json
import statistics
import time

import torch

from kvfuse.config import Settings
from kvfuse.fusion.engine.fused_cache import FusedCache
from kvfuse.fusion.fusion_engine import FusionEngine


def step_time(engine: FusionEngine, batch: int, length: int, steps: int) -> float:
    """Median seconds of one decode step of `batch` sequences whose caches hold `length` tokens."""
    tf = engine.tf
    caches = []
    for _ in range(batch):
        c = FusedCache(tf.num_layers, tf.num_kv_heads, tf.head_dim, length + steps + 2, engine.dtype,
                       engine.device)
        c.k[:, :, :length].normal_()
        c.v[:, :, :length].normal_()
        c.length = length
        caches.append(c)
    tokens = torch.full((batch,), 42, dtype=torch.long)
    engine.decode_batch(caches, tokens)  # warm-up
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.decode_batch(caches, tokens)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--lengths", default="16,2048,4096")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json")
    a = p.parse_args()
    settings = Settings()
    engine = FusionEngine.from_settings(settings, threads=a.threads)
    rows = []
    for length in [int(x) for x in a.lengths.split(",")]:
        for batch in [int(x) for x in a.batches.split(",")]:
            s = step_time(engine, batch, length, a.steps)
            rows.append({"cache_tokens": length, "batch": batch, "step_s": round(s, 4),
                         "tokens_per_s": round(batch / s, 1)})
            print(f"cache {length:5d}  batch {batch:2d}  step {s * 1000:7.1f} ms  {batch / s:6.1f} tok/s",
                  flush=True)
    tf = engine.tf
    kv_bytes = tf.num_layers * 2 * tf.num_kv_heads * tf.head_dim * torch.finfo(engine.dtype).bits // 8
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    out = {"command": "python studies/decode_step.py " + " ".join(
               f"--{k} {v}" for k, v in vars(a).items() if v is not None),
           "threads": a.threads, "kv_bytes_per_token": kv_bytes, "weight_bytes": weights, "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}))


if __name__ == "__main__":
    main()
