"""`kvfuse bench corpus`: a corpus many times a host's LMDB budget, served through a real server's HTTP API
with its chunk KV in an S3 object store beneath the budget, against the same corpus with everything
local and against vanilla (a full prefill), under one skewed trace, in one run (docs/DESIGN.md, "Storage").

The corpus: Paul Graham essays (bench.data_dir) cut into documents of `--doc-chars` characters until
`--tokens` tokens. The trace: each query draws `--docs-per-query` documents by Zipf(`--skew`) over a
random popularity rank (tiers.make_trace, the trace `kvfuse bench tiers` chose the eviction policy on)
and names them (`document_ids`), its `top_k` chunks retrieved from them. Two servers in turn (`kvfuse
serve`, a fresh data dir each, the RAM and device tiers off so the LMDB and object tiers are what is
measured):

Both servers compute a chunk's KV after the context `--precompute-context` names (the setting's by
default): what precompute costs, never how a stored chunk is read or fused.

1. **local**: no LMDB budget, no object store. The corpus is ingested (timed), its KV bytes summed over
   its documents' records; the trace runs with the default fusion method, then with
   `vanilla` over the same queries.
2. **tiered**: `store.lmdb_budget_mb` at `--budget-share` of those bytes, `object_store` on a SeaweedFS
   the bench starts (seaweedfs.py, the tests' server). The corpus is ingested again (timed) and the same
   trace runs with the default method; then `kvfuse bench object-store`'s GET measurement (object_store.py)
   reads chunk-sized objects from the same SeaweedFS: the bandwidth and per-request latency the
   break-even arithmetic (corpus_report.py) starts from.

Per phase: ingest seconds, bytes per tier after the trace, reads per tier during it (the
`kvfuse_kv_tier_reads_total` counters: a tier's hit rate is its reads over the trace's chunks), chunks
computed, TTFT p50/p99 (the server's `timings.ttft_ms`), and each query's answer (`--max-tokens` greedy
tokens): the issue's target is that the tiered server's answers equal the local one's at the default
ratio, which the summary counts (corpus_report.answers_agree). The queries' first `--warmup` are run and
not counted (first calls compile and fill caches). Progress goes to stderr, one line per ingest batch and
per query.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvfuse.bench.plots import plot_if_possible

QUESTIONS = ("What is the main argument here?", "What advice does the author give?",
             "Which examples does the author use?", "What does the author say about startups?",
             "What mistake does the author warn about?", "How does the author define success?")
_METRIC = re.compile(r'^(kvfuse_kv_tier_reads_total|kvfuse_kv_tier_bytes|kvfuse_kv_tier_evictions_total|'
                     r'kvfuse_kv_chunk_sources_total)\{([^}]*)\} ([0-9.eE+-]+)$')


def documents(data_dir: Path, tokens: int, doc_chars: int, chars_per_token: float = 4.0) -> list[tuple[str, str]]:
    """(id, text) of essay pieces of `doc_chars` characters (cut on a word), until about `tokens` tokens."""
    from kvfuse.bench.data import load_essays

    out: list[tuple[str, str]] = []
    budget = tokens * chars_per_token
    for name, text in load_essays(data_dir):
        for i in range(0, len(text) - doc_chars // 4, doc_chars):
            piece = text[i:i + doc_chars]
            piece = piece[: piece.rfind(" ")] if " " in piece and i + doc_chars < len(text) else piece
            out.append((f"c-{name}-{i // doc_chars}", piece.strip()))
            budget -= len(piece)
            if budget <= 0:
                return out
    return out


def trace(chunks_per_doc: list[int], queries: int, skew: float, docs_per_query: int, seed: int) -> list[list[int]]:
    """Per query, the documents (indices) it names: tiers.make_trace's Zipf draw over documents."""
    from kvfuse.bench.tiers import Corpus, make_trace

    doc_chunks, first = [], 0
    for n in chunks_per_doc:
        doc_chunks.append(range(first, first + n))
        first += n
    owner = {c: d for d, ids in enumerate(doc_chunks) for c in ids}
    corpus = Corpus(sizes=[0] * first, costs={}, doc_chunks=doc_chunks)
    ns = argparse.Namespace(queries=queries, docs_per_query=docs_per_query, chunks_per_doc=1)
    return [list(dict.fromkeys(owner[c] for c in q)) for q in make_trace(corpus, skew, 0, ns, random.Random(seed))]


def scrape(c: Any) -> dict[str, float]:
    """The tier counters and gauges of the server's /metrics, as `name{labels}` -> value."""
    out: dict[str, float] = {}
    for line in c.get("/metrics").text.splitlines():
        m = _METRIC.match(line)
        if m:
            out[f"{m.group(1)}{{{m.group(2)}}}"] = float(m.group(3))
    return out


def tier_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, dict[str, float]]:
    """Reads per tier over the trace (counter deltas), bytes per tier after it, evictions, chunk sources."""
    def by(prefix: str, delta: bool) -> dict[str, float]:
        out = {}
        for key, v in after.items():
            if key.startswith(prefix + "{"):
                label = ",".join(x.split("=", 1)[1].strip('"') for x in key[len(prefix) + 1:-1].split(","))
                out[label] = v - before.get(key, 0.0) if delta else v
        return out

    return {"reads": by("kvfuse_kv_tier_reads_total", True), "bytes": by("kvfuse_kv_tier_bytes", False),
            "evictions": by("kvfuse_kv_tier_evictions_total", True),
            "sources": by("kvfuse_kv_chunk_sources_total", True)}


def progress(msg: str) -> None:
    print(f"[corpus {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ingest(c: Any, docs: list[tuple[str, str]], batch: int = 8) -> float:
    """Seconds to ingest every document (batches, each waited for until ready)."""
    t0 = time.perf_counter()
    chars = 0
    for i in range(0, len(docs), batch):
        resp = c.post("/v1/documents?wait=true", json={"documents": [
            {"id": d, "text": t, "on_conflict": "overwrite"} for d, t in docs[i:i + batch]]})
        resp.raise_for_status()
        bad = [d for d in resp.json()["documents"] if d["status"] != "ready"]
        if bad:
            raise RuntimeError(f"not ready after ingestion: {bad}")
        chars += sum(len(t) for _, t in docs[i:i + batch])
        dt = time.perf_counter() - t0
        progress(f"ingested {min(i + batch, len(docs))}/{len(docs)} documents in {dt:.0f} s "
                 f"(about {chars / 4 / dt:.0f} tokens/s)")
    return time.perf_counter() - t0


def ask(c: Any, doc_ids: list[str], question: str, top_k: int, method: str | None,
        max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"query": question, "document_ids": doc_ids, "top_k": top_k, "max_tokens": max_tokens,
                            "temperature": 0.0}
    if method:
        body["fusion"] = {"method": method}
    resp = c.post("/v1/query", json=body)
    resp.raise_for_status()
    a = resp.json()
    return {"ttft_ms": a["timings"]["ttft_ms"], "kv_load_ms": a["timings"]["kv_load_ms"], "answer": a["answer"],
            "chunks_read": a["usage"].get("chunks_read") or 0, "chunks_computed": a["usage"].get("chunks_computed") or 0}


def run_trace(c: Any, ids: list[str], queries: list[list[int]], args: argparse.Namespace, method: str | None,
              label: str) -> dict[str, Any]:
    """The trace's queries in order; the first `args.warmup` not counted. TTFT p50/p99, the tier figures and
    the answers."""
    from kvfuse.bench.load import percentile

    for q, docs in enumerate(queries[:args.warmup]):
        ask(c, [ids[d] for d in docs], QUESTIONS[q % len(QUESTIONS)], args.top_k, method, args.max_tokens)
    before = scrape(c)
    rows = []
    for q, docs in enumerate(queries[args.warmup:]):
        rows.append(ask(c, [ids[d] for d in docs], QUESTIONS[(q + args.warmup) % len(QUESTIONS)], args.top_k,
                        method, args.max_tokens))
        if (q + 1) % 10 == 0 or q + 1 == len(queries) - args.warmup:
            progress(f"{label}: {q + 1}/{len(queries) - args.warmup} queries, last TTFT {rows[-1]['ttft_ms']:.0f} ms")
    ttft = [r["ttft_ms"] for r in rows]
    return {"queries": len(rows), "ttft_p50_ms": round(percentile(ttft, 50), 1),
            "ttft_p99_ms": round(percentile(ttft, 99), 1),
            "chunks_read": sum(r["chunks_read"] for r in rows),
            "chunks_computed": sum(r["chunks_computed"] for r in rows),
            "tiers": tier_figures(before, scrape(c)), "ttft_ms": ttft, "answers": [r["answer"] for r in rows]}


def _lmdb_file_mb(server: Any) -> float:
    files = list(Path(server.tmp.name).rglob("data.mdb"))
    return round(sum(f.stat().st_size for f in files) / 2**20, 2)


def phase(name: str, env: dict[str, str], docs: list[tuple[str, str]], args: argparse.Namespace,
          queries: list[list[int]] | None, methods: list[str | None]) -> dict[str, Any]:
    """One server: ingest the corpus, then the trace once per method (None: the default)."""
    import httpx

    from kvfuse.bench.load import LocalServer
    from kvfuse.config import get_settings

    # the caller's prepared model copies: a fresh data dir would prepare the model again
    base = {"KVFUSE_STORE__HOT_TIER_MB": "0", "KVFUSE_STORE__DEVICE_TIER_MB": "0",
            "KVFUSE_STORE__PRECOMPUTE_AT": "ingest", "KVFUSE_MODEL_CACHE_DIR": str(get_settings().models_dir.resolve())}
    if args.precompute_context:  # both servers alike: what a chunk's KV is computed after, not how it is read
        base["KVFUSE_STORE__PRECOMPUTE_CONTEXT"] = args.precompute_context
    progress(f"{name}: starting a server")
    with LocalServer(env=base | env) as server, httpx.Client(base_url=server.url, timeout=args.timeout_s) as c:
        out: dict[str, Any] = {"ingest_s": round(ingest(c, docs), 2)}
        metas = [c.get(f"/v1/documents/{d}").json() for d, _ in docs]
        out |= {"documents": len(docs), "chunks": sum(m["chunks"] for m in metas),
                "tokens": sum(m["tokens"] for m in metas), "chunks_per_doc": [m["chunks"] for m in metas],
                "kv_bytes": sum(m.get("kv_bytes") or 0 for m in metas),
                "bytes_after_ingest": tier_figures({}, scrape(c))["bytes"]}
        if queries is None:
            queries = trace(out["chunks_per_doc"], args.queries + args.warmup, args.skew, args.docs_per_query,
                            args.seed)
        out["trace"] = queries
        ids = [d for d, _ in docs]
        out["runs"] = {m or "default": run_trace(c, ids, queries, args, m, f"{name} {m or 'default'}")
                       for m in methods}
        out["lmdb_file_mb"] = _lmdb_file_mb(server)
    return out


def run(args: argparse.Namespace, docs: list[tuple[str, str]]) -> dict[str, Any]:
    """Both phases and the object store's GET figures (see the module docstring)."""
    from kvfuse.bench import object_store
    from kvfuse.bench.seaweedfs import SeaweedFS
    from kvfuse.config import ObjectStoreSettings

    local = phase("local", {}, docs, args, None, [None, "vanilla"])
    kv_bytes = local["kv_bytes"] or local["runs"]["default"]["tiers"]["bytes"].get("lmdb", 0.0)
    if not kv_bytes:
        raise RuntimeError("the local server reported no KV bytes for the corpus")
    budget_mb = max(1, round(kv_bytes * args.budget_share / 2**20))
    with tempfile.TemporaryDirectory(prefix="kvfuse-bench-corpus-s3-") as tmp:
        s3 = SeaweedFS(Path(tmp)).start()
        try:
            env = {"KVFUSE_STORE__LMDB_BUDGET_MB": str(budget_mb), "KVFUSE_OBJECT_STORE__URL": s3.url("corpus"),
                   "KVFUSE_OBJECT_STORE__ENDPOINT": s3.endpoint, **s3.env()}
            tiered = phase("tiered", env, docs, args, local["trace"], [None])
            os.environ.update(s3.env())
            cfg = ObjectStoreSettings(url=s3.url("bench-gets"), endpoint=s3.endpoint)
            chunk_bytes = int(kv_bytes / max(1, local["chunks"]))
            gets = object_store.run(cfg, ["obstore"], [chunk_bytes], args.get_objects, args.get_threads,
                                    latency_gets=20, repeats=1)
        finally:
            s3.kill()
    return {"local": local, "tiered": tiered, "budget_mb": budget_mb, "kv_bytes": kv_bytes,
            "chunk_bytes": chunk_bytes, "object_gets": gets}


def command(args: argparse.Namespace) -> int:
    from kvfuse.bench import corpus_report
    from kvfuse.bench.data import resolve_data_dir
    from kvfuse.bench.machine import command_line, load_info, machine_info

    docs = documents(resolve_data_dir(args.data_dir), args.tokens, args.doc_chars)
    t0 = time.perf_counter()
    result = run(args, docs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = command_line("kvfuse bench corpus", args.parser, args)
    result |= {"command": cmd, "seconds": round(time.perf_counter() - t0, 1), "machine": machine_info(),
               "load": load_info(), "params": {k: getattr(args, k) for k in (
                   "tokens", "doc_chars", "budget_share", "queries", "warmup", "skew", "docs_per_query", "top_k",
                   "seed", "max_tokens", "precompute_context", "prefill_tokens_per_s", "bytes_per_token_8b")}}
    (out / "corpus.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")  # kept if the report fails
    result["summary"] = corpus_report.summary(result)
    (out / "corpus.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    (out / "corpus.md").write_text(corpus_report.render(result), encoding="utf-8")
    plot_if_possible(corpus_report.plot, result, out / "corpus.png")
    print(json.dumps(result["summary"], indent=1))
    return 0


def register(bsub: Any) -> None:
    """Add `kvfuse bench corpus` (imports nothing heavy)."""
    from kvfuse.bench.args import csv_list
    from kvfuse.bench.data import DATA_DIR_HELP

    p = bsub.add_parser("corpus", help="a corpus 10x the LMDB budget on an object store vs all local vs vanilla")
    p.add_argument("--tokens", type=int, default=24000, help="corpus size in tokens (about)")
    p.add_argument("--doc-chars", type=int, default=3000, help="characters per document")
    p.add_argument("--budget-share", type=float, default=0.1, help="LMDB budget as a share of the corpus's KV")
    p.add_argument("--queries", type=int, default=60, help="queries in the trace (counted)")
    p.add_argument("--warmup", type=int, default=3, help="queries run first and not counted")
    p.add_argument("--skew", type=float, default=0.8, help="Zipf exponent over documents (0.8: web-object popularity, "
                   "the harder of the two skews bench tiers chose the policy on)")
    p.add_argument("--docs-per-query", type=int, default=2, help="documents each query names")
    p.add_argument("--top-k", type=int, default=4, help="chunks each query fuses")
    p.add_argument("--max-tokens", type=int, default=8, help="greedy answer tokens per query (answers compared)")
    p.add_argument("--precompute-context", default=None,
                   help="store.precompute_context of both servers (default: the setting's); `document` spares a "
                        "document's first chunk its neighbours' tokens, the bulk of ingestion's compute")
    p.add_argument("--seed", type=int, default=0, help="trace seed")
    p.add_argument("--get-objects", type=int, default=32, help="chunk-sized objects the GET measurement reads")
    p.add_argument("--get-threads", type=csv_list(int), default=[1, 8], help="parallel GETs measured")
    p.add_argument("--prefill-tokens-per-s", type=float, default=34000.0,
                   help="8B prefill rate of a GPU host for the arithmetic (docs/results/gpu: vanilla at 4k)")
    p.add_argument("--bytes-per-token-8b", type=float, default=66.6e3,
                   help="KV bytes per token of an 8B model (Llama-3.1-8B's shape) at int8")
    p.add_argument("--timeout-s", type=float, default=1800, help="HTTP timeout per request")
    p.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
    p.add_argument("--out", default="docs/results/corpus", help="folder of corpus.json, .md and .png")
    p.set_defaults(func=command, parser=p)
