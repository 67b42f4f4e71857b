"""`kvfuse bench tiers`: the eviction policies of a bounded KV tier (store/eviction_policy.py) replayed on
a skewed query trace, at budgets of a share of the corpus, in one run.

The corpus: `--docs` documents of lognormal length (median `--doc-tokens`), cut into `--chunk-tokens`
chunks (the last one shorter); a chunk's bytes are its tokens at `--bytes-per-token` (the default model
at int8), its recompute seconds its tokens at `--precompute-rate` (plus, in the `context` cost model, the
up to `--context-tokens` of its document before it, which a chunk computed after its context is rebuilt
with). The trace: each query picks `--docs-per-query` documents by Zipf(s) over a random popularity rank
(documents, not chunks, are what users ask about) and `--chunks-per-doc` of each one's chunks at random,
as a retriever's top-k would. Every chunk is ingested first, in document order, as the service stores
them; then each query's chunks are read: a hit is an access, a miss is stored again (rebuilt, or read
from a lower tier and written back), the query's chunks pinned meanwhile.

Per policy, skew and budget: the byte hit rate (bytes read from the tier / bytes the queries asked for)
and the recompute seconds saved (the share of the trace's recompute seconds the hits spared), and the
chunk hit rate. Pure bookkeeping, no model.

`--lmdb-budgets`: also the LMDB file of a real bounded store filled with many budgets of KV, its slack
over the budget (tiers_lmdb.py).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfuse.store.eviction_policy import POLICIES, make_policy

TABLE = (("skew", "Zipf s"), ("trace", "popularity"), ("cost_model", "cost"), ("budget_share", "budget"), ("policy", "policy"),
         ("byte_hit_rate", "byte hit rate"), ("recompute_saved", "recompute s saved"),
         ("hit_rate", "chunk hit rate"), ("evictions", "evictions"))


@dataclass(frozen=True)
class Corpus:
    sizes: list[int]  # bytes per chunk
    costs: dict[str, list[float]]  # cost model -> recompute seconds per chunk
    doc_chunks: list[range]  # chunk ids per document


def make_corpus(args: argparse.Namespace, rng: random.Random) -> Corpus:
    sizes: list[int] = []
    alone: list[float] = []
    ctx: list[float] = []
    doc_chunks = []
    for _ in range(args.docs):
        tokens = max(1, int(rng.lognormvariate(math.log(args.doc_tokens), 0.8)))
        first = len(sizes)
        for start in range(0, tokens, args.chunk_tokens):
            n = min(args.chunk_tokens, tokens - start)
            sizes.append(int(n * args.bytes_per_token))
            alone.append(n / args.precompute_rate)
            ctx.append((n + min(start, args.context_tokens)) / args.precompute_rate)
        doc_chunks.append(range(first, len(sizes)))
    return Corpus(sizes, {"alone": alone, "context": ctx}, doc_chunks)


def make_trace(corpus: Corpus, skew: float, shifts: int, args: argparse.Namespace,
               rng: random.Random) -> list[list[int]]:
    """`shifts` > 0: the popularity rank is drawn again that many times, evenly through the trace (what
    users ask about changes; a policy that only counts keeps what was popular)."""
    n = len(corpus.doc_chunks)
    weights = [1.0 / (r + 1) ** skew for r in range(n)]
    rank = list(range(n))
    rng.shuffle(rank)  # popularity is not document order (ingestion order)
    trace = []
    every = args.queries // (shifts + 1) if shifts else 0
    for q in range(args.queries):
        if every and q and q % every == 0:
            rng.shuffle(rank)
        chunks: list[int] = []
        for d in dict.fromkeys(rng.choices(rank, weights=weights, k=args.docs_per_query)):
            ids = corpus.doc_chunks[d]
            chunks += rng.sample(list(ids), min(args.chunks_per_doc, len(ids)))
        trace.append(chunks)
    return trace


def replay(policy_name: str, budget: int, corpus: Corpus, costs: list[float], trace: list[list[int]]) -> dict:
    """The trace through a tier of `budget` bytes under the policy (see the module docstring)."""
    p = make_policy(policy_name, budget)
    evictions = 0

    def store(c: int, pinned: frozenset) -> None:
        nonlocal evictions
        over = p.bytes + corpus.sizes[c] - budget
        if over > 0:
            evictions += len(p.victims(over, pinned))
        if p.bytes + corpus.sizes[c] <= budget:
            p.insert(str(c), corpus.sizes[c], costs[c])

    for c in range(len(corpus.sizes)):  # ingestion
        store(c, frozenset())
    asked = hit_bytes = hits = reads = 0
    cost_all = cost_saved = 0.0
    for chunks in trace:
        pinned = frozenset(str(c) for c in chunks)
        for c in chunks:
            reads += 1
            asked += corpus.sizes[c]
            cost_all += costs[c]
            if p.access(str(c)):
                hits += 1
                hit_bytes += corpus.sizes[c]
                cost_saved += costs[c]
            else:
                store(c, pinned)
    return {"byte_hit_rate": hit_bytes / asked, "recompute_saved": cost_saved / cost_all,
            "hit_rate": hits / reads, "evictions": evictions}


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    corpus = make_corpus(args, rng)
    total = sum(corpus.sizes)
    rows = []
    t0 = time.perf_counter()
    for skew in args.skews:
        for label, shifts in (("static", 0), (f"{args.shifts} shifts", args.shifts)):
            if label != "static" and not shifts:
                continue
            trace = make_trace(corpus, skew, shifts, args, random.Random(args.seed + 1))
            for cost_model in args.cost_models:
                for share in args.budgets:
                    for name in args.policies:
                        row = {"skew": skew, "trace": label, "cost_model": cost_model, "budget_share": share,
                               "policy": name}
                        rows.append(row | replay(name, int(total * share), corpus, corpus.costs[cost_model], trace))
                        print(f"s={skew} {label} {cost_model} {share:.0%} {name}: "
                              f"byte hit {rows[-1]['byte_hit_rate']:.3f}", file=sys.stderr)
    return {"kind": "tiers", "corpus": {"documents": args.docs, "chunks": len(corpus.sizes),
                                         "bytes": total, "tokens": round(sum(corpus.costs["alone"]) * args.precompute_rate)},
            "seconds": round(time.perf_counter() - t0, 1), "rows": rows}


def write_table(out: dict, path: Path) -> None:
    lines = ["| " + " | ".join(h for _, h in TABLE) + " |", "|" + "---|" * len(TABLE)]
    for r in out["rows"]:
        cells = [f"{r[k]:.3f}" if isinstance(r[k], float) and k not in ("skew",) else str(r[k]) for k, _ in TABLE]
        cells[3] = f"{r['budget_share']:.0%}"
        lines.append("| " + " | ".join(cells) + " |")
    c = out["corpus"]
    head = (f"`{out['command']}`\n\n{c['documents']} documents, {c['chunks']} chunks, {c['tokens']} tokens, "
            f"{c['bytes'] / 2**30:.2f} GiB of KV; {out['queries']} queries.\n\n")
    tail = ""
    if out.get("lmdb"):
        from kvfuse.bench.tiers_lmdb import table

        tail = "\nThe LMDB file of a bounded store (`--lmdb-budgets`):\n\n" + table(out["lmdb"])
    path.write_text(head + "\n".join(lines) + "\n" + tail, encoding="utf-8")


def plot(out: dict, path: Path) -> None:
    from kvfuse.bench.plots import pyplot

    plt = pyplot()
    cases = list(dict.fromkeys((r["skew"], r["trace"]) for r in out["rows"]))
    metrics = (("byte_hit_rate", "byte hit rate", "alone"), ("recompute_saved", "recompute s saved", "context"))
    fig, axes = plt.subplots(len(metrics), len(cases), figsize=(4 * len(cases), 7), squeeze=False)
    for j, (skew, trace) in enumerate(cases):
        for i, (metric, label, cost_model) in enumerate(metrics):
            ax = axes[i][j]
            for name in POLICIES:
                pts = [(r["budget_share"], r[metric]) for r in out["rows"] if r["skew"] == skew
                       and r["trace"] == trace and r["policy"] == name and r["cost_model"] == cost_model]
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=name)
            ax.set_title(f"Zipf s={skew}, {trace} ({cost_model} cost)", fontsize=9)
            ax.set_xlabel("budget (share of the corpus's KV)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def command(args: argparse.Namespace) -> int:
    from kvfuse.bench.machine import command_line

    bad = [p for p in args.policies if p not in POLICIES]
    if bad:
        print(f"--policies: {', '.join(bad)} not among {', '.join(POLICIES)}", file=sys.stderr)
        return 2
    out = run(args) | {"command": command_line("kvfuse bench tiers", args.parser, args), "queries": args.queries}
    if args.lmdb_budgets:
        from kvfuse.bench import tiers_lmdb

        out["lmdb"] = [tiers_lmdb.measure(b, share, args.lmdb_multiple, args.lmdb_chunk_tokens, args.lmdb_policy,
                                          args.seed)
                       for b in args.lmdb_budgets for share in args.lmdb_full_shares]
    json_path = Path(args.json)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    write_table(out, json_path.with_suffix(".md"))
    plot(out, json_path.with_suffix(".png"))
    print(json_path.with_suffix(".md").read_text(encoding="utf-8"))
    return 0


def register(bsub: Any) -> None:
    """Add `kvfuse bench tiers` (imports nothing heavy)."""
    from kvfuse.bench.args import csv_list

    p = bsub.add_parser("tiers", help="eviction policies of a bounded KV tier on a Zipf query trace")
    p.add_argument("--docs", type=int, default=3000, help="documents in the corpus")
    p.add_argument("--doc-tokens", type=int, default=2048, help="median document length in tokens")
    p.add_argument("--chunk-tokens", type=int, default=512, help="tokens per chunk")
    p.add_argument("--bytes-per-token", type=float, default=11.9e3, help="KV bytes per token at rest")
    p.add_argument("--precompute-rate", type=float, default=116.0, help="precompute tokens per second")
    p.add_argument("--context-tokens", type=int, default=1024,
                   help="context a chunk is recomputed after, in the `context` cost model")
    p.add_argument("--queries", type=int, default=20000, help="queries in the trace")
    p.add_argument("--shifts", type=int, default=3,
                   help="a second trace whose popularity rank is drawn again this many times (0: none)")
    p.add_argument("--docs-per-query", type=int, default=2, help="documents each query draws")
    p.add_argument("--chunks-per-doc", type=int, default=3, help="chunks taken from each drawn document")
    p.add_argument("--skews", type=csv_list(float), default=[0.8, 1.2], help="Zipf exponents over documents")
    p.add_argument("--budgets", type=csv_list(float), default=[0.05, 0.1, 0.2], help="budgets, shares of the corpus")
    p.add_argument("--policies", type=csv_list(str), default=list(POLICIES), help="policies to compare")
    p.add_argument("--cost-models", type=csv_list(str), default=["alone", "context"],
                   help="recompute cost of a chunk: alone, or after its context")
    p.add_argument("--lmdb-budgets", type=csv_list(int), default=[],
                   help="also fill a real bounded LMDB store at each of these budgets (MB) and measure its file")
    p.add_argument("--lmdb-multiple", type=int, default=10, help="budgets of KV ingested into each")
    p.add_argument("--lmdb-chunk-tokens", type=int, default=128, help="tokens of a full-sized chunk there")
    p.add_argument("--lmdb-full-shares", type=csv_list(float), default=[1.0, 0.75, 0.0],
                   help="shares of full-sized chunks (the rest shorter, of random length)")
    p.add_argument("--lmdb-policy", default="s3fifo", help="eviction policy of those stores")
    p.add_argument("--seed", type=int, default=0, help="corpus and trace seed")
    p.add_argument("--json", default="docs/results/tiers/tiers.json",
                   help="result file; the .md table and .png plot are written beside it")
    p.set_defaults(func=command, parser=p)
