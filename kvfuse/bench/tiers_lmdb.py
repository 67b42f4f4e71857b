"""`kvfuse bench tiers --lmdb-budgets ...`: the LMDB file of a bounded store after ingesting many budgets
of chunk KV (store.lmdb_budget_mb), its slack over the budget and how it grows.

Documents of 1-4 chunks are ingested as the service stores them (record with its refs, each blob in its
own transaction, then `ready`), every other one read back; a share `--lmdb-full-share` of the chunks is
full-sized (`--lmdb-chunk-tokens`), the others shorter (a document's last chunk). The KV is random, of the
default model's shape, in the store's default format. Per budget and share: the file's size after each
budget ingested, so the table shows where it stops growing; the slack is the file's size over the budget.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64  # the default model (SmolLM2-135M)
FINGERPRINT = "bench-tiers"


_KV: dict[int, tuple] = {}


def _blob(seed: int, tokens: int, dtype: str) -> tuple[str, bytes]:
    """A chunk blob of random KV (one draw per length, shared: only the bytes' count matters here) under
    a key of its own (random token ids)."""
    import torch

    from kvfuse import kvblob

    if tokens not in _KV:
        g = torch.Generator().manual_seed(tokens)
        _KV[tokens] = (torch.randn(LAYERS, KV_HEADS, tokens, HEAD_DIM, generator=g),
                       torch.randn(LAYERS, KV_HEADS, tokens, HEAD_DIM, generator=g))
    k, v = _KV[tokens]
    ids = random.Random(seed).choices(range(49152), k=tokens)
    return kvblob.chunk_key(FINGERPRINT, dtype, ids), kvblob.encode(k, v, model_fingerprint=FINGERPRINT,
                                                                     token_ids=ids, dtype=dtype)


def measure(budget_mb: int, full_share: float, multiple: int, chunk_tokens: int, policy: str, seed: int) -> dict:
    """One bounded store filled with `multiple` budgets of KV (see the module docstring)."""
    from kvfuse.config import load_settings
    from kvfuse.store.kvstore import KVStore
    from kvfuse.store.records import DocumentRecord

    root = Path(tempfile.mkdtemp(prefix="kvfuse-bench-tiers-"))
    settings = load_settings(data_dir=root, redis_url="", store={
        "lmdb_budget_mb": budget_mb, "eviction_policy": policy, "hot_tier_mb": 0})
    rng = random.Random(seed)
    budget = budget_mb << 20
    growth, largest, n, doc = [], 0, 0, 0
    try:
        with KVStore.open(settings) as store:
            dtype = settings.store.kv_dtype
            while len(growth) < multiple:
                blobs = []
                for _ in range(rng.randint(1, 4)):
                    n += 1
                    full = rng.random() < full_share
                    blobs.append(_blob(n, chunk_tokens if full else rng.randint(chunk_tokens // 8, chunk_tokens - 1), dtype))
                    largest = max(largest, len(blobs[-1][1]))
                store.catalog.put_document(DocumentRecord(id=f"d{doc}", status="processing",
                                                          chunk_keys=[k for k, _ in blobs]), "text")
                for key, blob in blobs:
                    store.put_chunk(key, blob)
                store.set_status(f"d{doc}", "ready")
                if doc % 2:
                    store.load_chunk(blobs[-1][0])
                doc += 1
                stats = store.stats()
                if stats["kv_bytes"] + stats.get("lmdb_evicted_bytes", 0) >= (len(growth) + 1) * budget:
                    growth.append((store.env.path / "data.mdb").stat().st_size)
            stats = store.stats()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    file_bytes = growth[-1]
    return {"budget_mb": budget_mb, "full_share": full_share, "chunk_tokens": chunk_tokens, "policy": policy,
            "documents": doc, "chunks": n, "largest_blob_mb": round(largest / 2**20, 2),
            "kv_mb": round(stats["kv_bytes"] / 2**20, 2), "evictions": stats["lmdb_evictions"],
            "file_mb": round(file_bytes / 2**20, 2), "slack_share": round(file_bytes / budget - 1, 3),
            "slack_blobs": round((file_bytes - budget) / largest, 1),
            "growth_mb": [round(b / 2**20, 1) for b in growth]}


LMDB_TABLE = (("budget_mb", "budget MB"), ("full_share", "full chunks"), ("largest_blob_mb", "largest blob MB"),
              ("documents", "documents"), ("evictions", "evictions"), ("kv_mb", "KV MB"), ("file_mb", "file MB"),
              ("slack_share", "slack / budget"), ("slack_blobs", "slack in largest blobs"),
              ("growth_mb", "file MB after each budget ingested"))


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(h for _, h in LMDB_TABLE) + " |", "|" + "---|" * len(LMDB_TABLE)]
    for r in rows:
        lines.append("| " + " | ".join(", ".join(map(str, r[k])) if isinstance(r[k], list) else str(r[k])
                                       for k, _ in LMDB_TABLE) + " |")
    return "\n".join(lines) + "\n"
