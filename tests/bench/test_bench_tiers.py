"""`kvfuse bench tiers` (kvfuse/bench/tiers.py): the replay of a trace through a bounded tier counts what
the policy's decisions give, on a case worked by hand and at a budget that holds everything."""

from __future__ import annotations

import argparse

from kvfuse.bench import tiers


def _args(**over) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    tiers.register(parser.add_subparsers())
    args = parser.parse_args(["tiers"])
    for k, v in over.items():
        setattr(args, k, v)
    return args


def test_replay_counts_hits_as_the_policy_decides() -> None:
    """Three one-byte chunks ingested into a two-byte LRU tier: 0 is evicted, 1 and 2 stay. Reads 1, 2
    hit; 0 misses and evicts 1 (the least recent); 0 again hits: 3 of 4."""
    corpus = tiers.Corpus(sizes=[1, 1, 1], costs={"alone": [1.0, 2.0, 4.0]}, doc_chunks=[range(3)])
    got = tiers.replay("lru", 2, corpus, corpus.costs["alone"], [[1], [2], [0], [0]])
    assert got == {"byte_hit_rate": 0.75, "recompute_saved": (2 + 4 + 1) / 8, "hit_rate": 0.75, "evictions": 2}


def test_a_budget_that_holds_the_corpus_hits_every_read() -> None:
    args = _args(docs=40, queries=200, budgets=[1.0, 0.1], skews=[1.0], cost_models=["alone"])
    out = tiers.run(args)
    full = [r for r in out["rows"] if r["budget_share"] == 1.0]
    assert len(full) == 2 * len(args.policies)  # static and shifting popularity
    assert all(r["byte_hit_rate"] == r["hit_rate"] == 1.0 and r["evictions"] == 0 for r in full)
    assert all(0 < r["byte_hit_rate"] < 1 for r in out["rows"] if r["budget_share"] == 0.1)
