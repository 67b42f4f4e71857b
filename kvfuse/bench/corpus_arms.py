"""`kvfuse bench corpus`'s three arms run on one trace in alternating blocks (corpus.py starts the servers).

The arms: **local** (the server with no budget, default method), **tiered** (the server with the LMDB
budget over the object store, default method) and **vanilla** (the local server, a full prefill). Both
servers are up at once and the trace's counted queries are cut into blocks of `--block` queries; every
arm runs each block in turn before the next block starts, the arms' order rotated one place per block
(`schedule`), so a change in the host's load (a shared machine's load drifts over minutes) lands on every
arm alike instead of on whichever ran last. Every arm sends the same queries in the same order, so the
answers compare query by query. Each block's tier counters are scraped from its arm's server before and
after it, so the local server's counters are split between its two arms exactly.

The first `--warmup` queries are run once per arm, first, and not counted (first calls compile and fill
caches). A block's p50 per arm is what the report's per-block ratios compare (corpus_report.py).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

ARMS = ("local", "tiered", "vanilla")


def schedule(queries: int, block: int, arms: tuple[str, ...] = ARMS) -> list[tuple[int, str, list[int]]]:
    """(block number, arm, query positions) in the order they are run: the positions 0..queries-1 cut
    into blocks of `block`, each block run by every arm, block b's arms starting at arms[b % len(arms)]."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    out = []
    for b, first in enumerate(range(0, queries, block)):
        positions = list(range(first, min(first + block, queries)))
        for i in range(len(arms)):
            out.append((b, arms[(b + i) % len(arms)], positions))
    return out


def add_figures(into: dict[str, dict[str, float]], fig: dict[str, dict[str, float]]) -> None:
    """Sum one block's counter deltas into an arm's; bytes (a gauge) is the latest block's."""
    for kind, values in fig.items():
        if kind == "bytes":
            into[kind] = dict(values)
            continue
        acc = into.setdefault(kind, {})
        for label, v in values.items():
            acc[label] = acc.get(label, 0.0) + v


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def run_arms(clients: dict[str, Any], ids: list[str], queries: list[list[int]], args: argparse.Namespace,
             ) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Every arm over the trace in alternating blocks. `clients`: arm -> (HTTP client, method or None).
    Returns per arm its run (as corpus.summarise_run makes it) and the blocks as run (arm, queries, p50,
    load average at its end)."""
    from kvfuse.bench.corpus_client import QUESTIONS, ask, progress, scrape, tier_figures
    from kvfuse.bench.load import percentile

    def one(arm: str, pos: int) -> dict[str, Any]:
        c, method = clients[arm]
        docs = queries[pos]
        return ask(c, [ids[d] for d in docs], QUESTIONS[pos % len(QUESTIONS)], args.top_k, method, args.max_tokens)

    for arm in clients:
        for pos in range(min(args.warmup, len(queries))):
            one(arm, pos)
    counted = len(queries) - args.warmup
    rows: dict[str, dict[int, dict[str, Any]]] = {arm: {} for arm in clients}
    figures: dict[str, dict[str, dict[str, float]]] = {arm: {} for arm in clients}
    blocks = []
    for b, arm, positions in schedule(counted, args.block, tuple(clients)):
        before = scrape(clients[arm][0])
        for p in positions:
            rows[arm][p] = one(arm, p + args.warmup)
        add_figures(figures[arm], tier_figures(before, scrape(clients[arm][0])))
        ttft = [rows[arm][p]["ttft_ms"] for p in positions]
        blocks.append({"block": b, "arm": arm, "queries": positions, "ttft_p50_ms": round(percentile(ttft, 50), 1),
                       "load_avg_1m": _load()})
        progress(f"block {b} {arm}: {len(positions)} queries, p50 {blocks[-1]['ttft_p50_ms']:.0f} ms, "
                 f"load {blocks[-1]['load_avg_1m']}")
    return {arm: summarise_run([rows[arm][p] for p in range(counted)], figures[arm]) for arm in clients}, blocks


def summarise_run(rows: list[dict[str, Any]], figures: dict[str, dict[str, float]]) -> dict[str, Any]:
    """One arm's figures over its counted queries, in trace order."""
    from kvfuse.bench.load import percentile

    ttft = [r["ttft_ms"] for r in rows]
    return {"queries": len(rows), "ttft_p50_ms": round(percentile(ttft, 50), 1),
            "ttft_p99_ms": round(percentile(ttft, 99), 1),
            "chunks_read": sum(r["chunks_read"] for r in rows),
            "chunks_computed": sum(r["chunks_computed"] for r in rows),
            "tiers": {k: figures.get(k, {}) for k in ("reads", "bytes", "evictions", "sources")},
            "ttft_ms": ttft, "answers": [r["answer"] for r in rows]}
