"""`kvfuse bench corpus`: a corpus many times a host's LMDB budget, served through a real server's HTTP API
with its chunk KV in an S3 object store beneath the budget, against the same corpus with everything
local and against vanilla (a full prefill), under one skewed trace, in one run (docs/DESIGN.md, "Storage").

The corpus: Paul Graham essays (bench.data_dir) cut into documents of `--doc-chars` characters until
`--tokens` tokens. The trace: each query draws `--docs-per-query` documents by Zipf(`--skew`) over a
random popularity rank (tiers.make_trace, the trace `kvfuse bench tiers` chose the eviction policy on)
and names them (`document_ids`), its `top_k` chunks retrieved from them. Two servers (`kvfuse serve`, a
fresh data dir each, the RAM and device tiers off so the LMDB and object tiers are what is measured), up
at the same time:

- **local**: no LMDB budget, no object store;
- **tiered**: `store.lmdb_budget_mb` at `--budget-share` of the corpus's KV (planned from its tokens
  before either ingests: planned_kv_bytes), `object_store` on a SeaweedFS the bench starts (seaweedfs.py,
  the tests' server).

Both compute a chunk's KV after the context `--precompute-context` names (the setting's by default): what
precompute costs, never how a stored chunk is read or fused. Both ingest the corpus at once (ingest_both:
each server's state is what its own ingestion leaves; each ingest time is timed with the other running
beside it). Then three arms run the same trace in alternating blocks (corpus_arms.py): the default fusion
method on each server, and `vanilla` (a full prefill) on the local one, so load drift on a shared host
lands on all three alike. Last, `kvfuse bench object-store`'s GET measurement (object_store.py) reads
chunk-sized objects from the same SeaweedFS: the bandwidth and per-request latency the break-even
arithmetic (corpus_report.py) starts from.

Per arm: ingest seconds, bytes per tier after the trace, reads per tier during it (the
`kvfuse_kv_tier_reads_total` counters: a tier's hit rate is its reads over the trace's chunks), chunks
computed, TTFT p50/p99 (the server's `timings.ttft_ms`) and per block, and each query's answer
(`--max-tokens` greedy tokens): the issue's target is that the tiered server's answers equal the local
one's at the default ratio, which the summary counts (corpus_report.answers_agree). Progress goes to
stderr, one line per ingest batch and per block.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from kvfuse.bench.corpus_client import QUESTIONS, ask, progress, scrape, tier_figures  # noqa: F401
from kvfuse.bench.plots import plot_if_possible


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


def ingest(c: Any, docs: list[tuple[str, str]], label: str = "", batch: int = 8) -> float:
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
        progress(f"{label} ingested {min(i + batch, len(docs))}/{len(docs)} documents in {dt:.0f} s "
                 f"(about {chars / 4 / dt:.0f} tokens/s)")
    return time.perf_counter() - t0


def _lmdb_file_mb(server: Any) -> float:
    files = list(Path(server.tmp.name).rglob("data.mdb"))
    return round(sum(f.stat().st_size for f in files) / 2**20, 2)


def planned_kv_bytes(docs: list[tuple[str, str]]) -> int:
    """The corpus's chunk KV at rest, planned before either server ingests (the tiered server's budget is
    set at its start): the documents' tokens under the model's tokenizer times the stored bytes per token
    of `store.kv_dtype` at the model's shape. The summary reports the ratio to the KV actually stored."""
    from transformers import AutoConfig, AutoTokenizer

    from kvfuse.config import get_settings
    from kvfuse.kv_formats import bytes_per_token
    from kvfuse.model_files import resolve_llm

    st = get_settings()
    path = resolve_llm(st.model.llm, st.models_dir.resolve())
    tok, cfg = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path)
    cfg = getattr(cfg, "text_config", cfg)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    per_token = bytes_per_token(st.store.kv_dtype, cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", heads),
                                head_dim)
    return int(sum(len(tok(t)["input_ids"]) for _, t in docs) * per_token)


def ingested(c: Any, docs: list[tuple[str, str]], seconds: float) -> dict[str, Any]:
    """What a server holds after ingestion: its documents' chunks, tokens and KV bytes, bytes per tier."""
    metas = [c.get(f"/v1/documents/{d}").json() for d, _ in docs]
    return {"ingest_s": round(seconds, 2), "documents": len(docs), "chunks": sum(m["chunks"] for m in metas),
            "tokens": sum(m["tokens"] for m in metas), "chunks_per_doc": [m["chunks"] for m in metas],
            "kv_bytes": sum(m.get("kv_bytes") or 0 for m in metas),
            "bytes_after_ingest": tier_figures({}, scrape(c))["bytes"]}


def ingest_both(clients: dict[str, Any], docs: list[tuple[str, str]]) -> dict[str, float]:
    """Both servers ingest the corpus at once (one thread each): one ingestion's wall time instead of two
    in turn, each server's state exactly what a lone ingestion leaves. Each figure is that server's
    seconds from its first request to its last document ready, the other ingesting beside it."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(clients)) as pool:
        futures = {name: pool.submit(ingest, c, docs, name) for name, c in clients.items()}
        return {name: f.result() for name, f in futures.items()}


def servers(stack: Any, s3: Any, budget_mb: int, args: argparse.Namespace) -> dict[str, Any]:
    """Both servers started (local: no budget, no object store; tiered: the budget over `s3`), each with
    an HTTP client; closed with `stack`."""
    import httpx

    from kvfuse.bench.load import LocalServer
    from kvfuse.config import get_settings

    # the caller's prepared model copies: a fresh data dir would prepare the model again
    base = {"KVFUSE_STORE__HOT_TIER_MB": "0", "KVFUSE_STORE__DEVICE_TIER_MB": "0",
            "KVFUSE_STORE__PRECOMPUTE_AT": "ingest", "KVFUSE_MODEL_CACHE_DIR": str(get_settings().models_dir.resolve())}
    if args.precompute_context:  # both servers alike: what a chunk's KV is computed after, not how it is read
        base["KVFUSE_STORE__PRECOMPUTE_CONTEXT"] = args.precompute_context
    envs = {"local": {}, "tiered": {"KVFUSE_STORE__LMDB_BUDGET_MB": str(budget_mb),
                                    "KVFUSE_OBJECT_STORE__URL": s3.url("corpus"),
                                    "KVFUSE_OBJECT_STORE__ENDPOINT": s3.endpoint, **s3.env()}}
    out = {}
    for name, env in envs.items():
        progress(f"{name}: starting a server")
        server = stack.enter_context(LocalServer(env=base | env))
        out[name] = (server, stack.enter_context(httpx.Client(base_url=server.url, timeout=args.timeout_s)))
    return out


def run(args: argparse.Namespace, docs: list[tuple[str, str]]) -> dict[str, Any]:
    """Both servers up, ingested at once, the three arms over one trace in alternating blocks
    (corpus_arms.py), then the object store's GET figures (see the module docstring)."""
    from contextlib import ExitStack

    from kvfuse.bench import object_store
    from kvfuse.bench.corpus_arms import run_arms
    from kvfuse.bench.machine import load_info
    from kvfuse.bench.seaweedfs import SeaweedFS
    from kvfuse.config import ObjectStoreSettings

    planned = planned_kv_bytes(docs)
    budget_mb = max(1, round(planned * args.budget_share / 2**20))
    load = {"start": load_info().get("load_avg_1m")}
    with tempfile.TemporaryDirectory(prefix="kvfuse-bench-corpus-s3-") as tmp:
        s3 = SeaweedFS(Path(tmp)).start()
        try:
            with ExitStack() as stack:
                up = servers(stack, s3, budget_mb, args)
                seconds = ingest_both({n: c for n, (_, c) in up.items()}, docs)
                load["after_ingest"] = load_info().get("load_avg_1m")
                phases = {n: ingested(c, docs, seconds[n]) for n, (_, c) in up.items()}
                local, tiered = phases["local"], phases["tiered"]
                queries = trace(local["chunks_per_doc"], args.queries + args.warmup, args.skew, args.docs_per_query,
                                args.seed)
                local["trace"] = tiered["trace"] = queries
                arms = {"local": (up["local"][1], None), "tiered": (up["tiered"][1], None),
                        "vanilla": (up["local"][1], "vanilla")}
                runs, blocks = run_arms(arms, [d for d, _ in docs], queries, args)
                load["after_trace"] = load_info().get("load_avg_1m")
                local["runs"] = {"default": runs["local"], "vanilla": runs["vanilla"]}
                tiered["runs"] = {"default": runs["tiered"]}
                for n, (server, _) in up.items():
                    phases[n]["lmdb_file_mb"] = _lmdb_file_mb(server)
            kv_bytes = local["kv_bytes"] or local["runs"]["default"]["tiers"]["bytes"].get("lmdb", 0.0)
            if not kv_bytes:
                raise RuntimeError("the local server reported no KV bytes for the corpus")
            os.environ.update(s3.env())
            cfg = ObjectStoreSettings(url=s3.url("bench-gets"), endpoint=s3.endpoint)
            chunk_bytes = int(kv_bytes / max(1, local["chunks"]))
            gets = object_store.run(cfg, ["obstore"], [chunk_bytes], args.get_objects, args.get_threads,
                                    latency_gets=20, repeats=1)
        finally:
            s3.kill()
    return {"local": local, "tiered": tiered, "blocks": blocks, "budget_mb": budget_mb, "planned_kv_bytes": planned,
            "kv_bytes": kv_bytes, "chunk_bytes": chunk_bytes, "object_gets": gets, "load_avg_1m": load}


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
                   "seed", "max_tokens", "block", "precompute_context", "prefill_tokens_per_s", "bytes_per_token_8b")}}
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
    p.add_argument("--doc-chars", type=int, default=1500, help="characters per document")
    p.add_argument("--budget-share", type=float, default=0.1, help="LMDB budget as a share of the corpus's KV")
    p.add_argument("--queries", type=int, default=50, help="queries in the trace (counted)")
    p.add_argument("--warmup", type=int, default=3, help="queries run first and not counted")
    p.add_argument("--skew", type=float, default=0.8, help="Zipf exponent over documents (0.8: web-object popularity, "
                   "the harder of the two skews bench tiers chose the policy on)")
    p.add_argument("--block", type=int, default=5, help="queries per block: the arms take turns a block at a time "
                   "(corpus_arms.py), so the host's load drifting lands on every arm alike")
    p.add_argument("--docs-per-query", type=int, default=3, help="documents each query names")
    p.add_argument("--top-k", type=int, default=4, help="chunks each query fuses")
    p.add_argument("--max-tokens", type=int, default=4, help="greedy answer tokens per query (answers compared)")
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
