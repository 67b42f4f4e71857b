"""`kvfuse bench retriever`: embedding throughput on real essay chunks, vector search latency at growing
corpus sizes for each index type, and the retrieval modes (dense, keyword, hybrid) on MuSiQue
(`retrieval_modes`: answer recall, MRR, latency, build time and size).

The size sweep uses synthetic unit vectors of the embedder's dimension, grouped like a corpus: each
document's chunks scatter around a random direction of its own (cosine about 0.5 between chunks of one
document, about 0 across documents), and each question sits near one document's direction. Flat search
cost depends only on the count and dimension. HNSW needs such structure: on uniformly random vectors
(no neighbourhoods at all) its recall collapses, which says nothing about embeddings of real text.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvfuse.bench.args import csv_list
from kvfuse.bench.data import DATA_DIR_HELP, load_essays, resolve_data_dir
from kvfuse.config import RetrieverSettings, Settings

VECTORS_PER_DOCUMENT = 100  # the sweep adds documents of this many chunks, as ingestion would
TOP_K = 4
QUESTION = "What did the author learn about startups from working on them?"


def run_retriever_bench(
    settings: Settings,
    *,
    sizes: tuple[int, ...] = (10_000, 100_000),
    progress: bool = True,
    queries: int = 200,
    data_dir: str | Path | None = None,
    max_chunks: int | None = None,
    index_types: tuple[str, ...] = ("flat", "hnsw"),
    modes_questions: int = 0,
    modes_chunk_tokens: tuple[int, ...] = (512,),
    rrf_ks: tuple[int, ...] = (60,),
) -> dict[str, Any]:
    """Measure; progress goes to stderr. Returns the JSON-ready result."""
    import faiss
    import torch

    from kvfuse.model_files import resolve_embedder, resolve_llm
    from kvfuse.retriever import Chunker, Embedder

    data = resolve_data_dir(data_dir, settings)
    essays = [text for _, text in load_essays(data)]
    chunker = Chunker.from_pretrained(resolve_llm(settings.model.llm, settings.models_dir),
                                      settings.retriever.chunk_tokens)
    embedder = Embedder(resolve_embedder(settings.model.embedder), device="cpu",
                        batch_size=settings.model.embed_batch_size)
    chunks = [c for text in essays for c in chunker.chunk(text)][:max_chunks]  # max_chunks=0: skip
    result: dict[str, Any] = {
        "machine": {
            "cpu_count": os.cpu_count(),
            "load_average_1m": round(os.getloadavg()[0], 2),
            "torch_threads": torch.get_num_threads(),
            "faiss_threads": faiss.omp_get_max_threads(),
            "faiss_version": faiss.__version__,
        },
        "embedder": {"model": settings.model.embedder, "dim": embedder.dim, "device": "cpu",
                     "batch_size": embedder.batch_size},
        "embed": _bench_embed(embedder, [c.text for c in chunks], sum(len(c.token_ids) for c in chunks),
                              settings.retriever.chunk_tokens, progress) if chunks else None,
        "search": [],
    }
    for n in sizes:
        vectors, query_vecs = _corpus_vectors(n, queries, embedder.dim, seed=n)
        exact: list[set[int]] | None = None
        for index_type in index_types:
            row, found = _bench_index(vectors, query_vecs, settings.retriever.model_copy(update={"index_type": index_type}),
                                      progress)
            if index_type == "flat":
                exact = found
            elif exact is not None:
                row["recall_at_k_vs_flat"] = round(
                    sum(len(a & b) for a, b in zip(found, exact, strict=True)) / (TOP_K * len(exact)), 4)
            result["search"].append(row)
    if modes_questions:
        from kvfuse.bench.retrieval_modes import run_modes_bench

        result["modes"] = run_modes_bench(settings, embedder, data, questions=modes_questions,
                                          chunk_tokens=modes_chunk_tokens, rrf_ks=rrf_ks, progress=progress)
    result["machine"]["load_average_1m_end"] = round(os.getloadavg()[0], 2)
    return result


def _bench_embed(embedder: Any, texts: list[str], llm_tokens: int, chunk_tokens: int,
                 progress: bool) -> dict[str, Any]:
    from tqdm import tqdm

    bs = embedder.batch_size
    embedder.embed(texts[:bs])  # warm-up: first calls pay for lazy initialization
    start = time.perf_counter()
    with tqdm(total=len(texts), desc="embed chunks", unit="chunk", file=sys.stderr, disable=not progress) as bar:
        for i in range(0, len(texts), bs):
            embedder.embed(texts[i : i + bs])
            bar.update(len(texts[i : i + bs]))
    seconds = time.perf_counter() - start
    q_ms = []
    for _ in range(20):
        t0 = time.perf_counter()
        embedder.embed([QUESTION])
        q_ms.append((time.perf_counter() - t0) * 1000)
    return {
        "chunks": len(texts),
        "chunk_tokens": chunk_tokens,
        "llm_tokens": llm_tokens,
        "seconds": round(seconds, 3),
        "chunks_per_s": round(len(texts) / seconds, 2),
        "llm_tokens_per_s": round(llm_tokens / seconds, 1),
        "question_embed_median_ms": round(statistics.median(q_ms), 2),
    }


def _bench_index(vectors: np.ndarray, queries: np.ndarray, rs: RetrieverSettings,
                 progress: bool) -> tuple[dict[str, Any], list[set[int]]]:
    from tqdm import tqdm

    from kvfuse.retriever import VectorIndex

    n = len(vectors)
    with tempfile.TemporaryDirectory(prefix="kvfuse-bench-faiss-") as tmp:
        idx = VectorIndex.open(Path(tmp), vectors.shape[1], rs)
        label = f"build {rs.index_type} {n:,}"
        start = time.perf_counter()
        with tqdm(total=n, desc=label, unit="vec", file=sys.stderr, disable=not progress) as bar:
            for d, i in enumerate(range(0, n, VECTORS_PER_DOCUMENT)):
                block = vectors[i : i + VECTORS_PER_DOCUMENT]
                idx.add(f"doc{d}", block, {"tenth": d % 10})
                bar.update(len(block))
        build_s = time.perf_counter() - start
        for q in queries[:10]:
            idx.search(q, TOP_K)  # warm-up
        lat, found = [], []
        for q in tqdm(queries, desc=f"search {rs.index_type} {n:,}", file=sys.stderr, disable=not progress):
            t0 = time.perf_counter()
            hits = idx.search(q, TOP_K)
            lat.append((time.perf_counter() - t0) * 1000)
            found.append({int(h.document_id[3:]) * VECTORS_PER_DOCUMENT + h.chunk_index for h in hits})
        filtered = []
        for q in queries[:50]:  # a metadata filter passing a tenth of the documents
            t0 = time.perf_counter()
            idx.search(q, TOP_K, filters={"tenth": 3})
            filtered.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        idx.save()
        save_s = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in Path(tmp).iterdir())
        t0 = time.perf_counter()
        VectorIndex.open(Path(tmp), vectors.shape[1], rs)
        open_s = time.perf_counter() - t0
    row: dict[str, Any] = {
        "index_type": rs.index_type,
        "vectors": n,
        "top_k": TOP_K,
        "queries": len(queries),
        "build_s": round(build_s, 3),
        "median_ms": round(statistics.median(lat), 3),
        "p95_ms": round(float(np.percentile(lat, 95)), 3),
        "filtered_median_ms": round(statistics.median(filtered), 3),
        "save_s": round(save_s, 3),
        "open_s": round(open_s, 3),
        "disk_bytes": size,
    }
    if rs.index_type == "hnsw":
        row.update(hnsw_m=rs.hnsw_m, ef_construction=rs.hnsw_ef_construction, ef_search=rs.hnsw_ef_search)
    return row, found


def _corpus_vectors(n: int, queries: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(n corpus vectors in documents of VECTORS_PER_DOCUMENT, question vectors); see the module doc."""
    rng = np.random.default_rng(seed)
    n_docs = -(-n // VECTORS_PER_DOCUMENT)
    centers = _unit(rng.standard_normal((n_docs, dim), dtype=np.float32))
    # Noise of norm ~1 around a unit direction: cosine ~1/2 between two vectors of one document.
    noise_scale = 1.0 / np.sqrt(dim)
    corpus = centers[np.arange(n) // VECTORS_PER_DOCUMENT]
    corpus += rng.standard_normal((n, dim), dtype=np.float32) * noise_scale
    asked = centers[rng.integers(0, n_docs, queries)]
    asked += rng.standard_normal((queries, dim), dtype=np.float32) * noise_scale
    return _unit(corpus), _unit(asked)


def _unit(v: np.ndarray) -> np.ndarray:
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def _format(result: dict[str, Any]) -> str:
    e = result["embed"]
    lines = [
        f"embedding: {e['chunks']} chunks of <= {e['chunk_tokens']} tokens in {e['seconds']} s = "
        f"{e['chunks_per_s']} chunks/s ({e['llm_tokens_per_s']} tokens/s); question {e['question_embed_median_ms']} ms"
        if e else "embedding: skipped",
        "",
        "| index | vectors | build s | median ms | p95 ms | filtered median ms | recall@4 | save s | open s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["search"]:
        lines.append(
            f"| {r['index_type']} | {r['vectors']:,} | {r['build_s']} | {r['median_ms']} | {r['p95_ms']} | "
            f"{r['filtered_median_ms']} | {r.get('recall_at_k_vs_flat', 1.0 if r['index_type'] == 'flat' else '-')} | "
            f"{r['save_s']} | {r['open_s']} |"
        )
    if result.get("modes"):
        from kvfuse.bench.retrieval_modes import format_modes

        lines += ["", format_modes(result["modes"])]
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    from kvfuse.config import get_settings

    if args.url:
        return _run_e2e(args, get_settings())
    result = run_retriever_bench(
        get_settings(),
        sizes=tuple(args.sizes),
        progress=not args.no_progress,
        queries=args.queries,
        data_dir=args.data_dir,
        max_chunks=args.max_chunks,
        modes_questions=args.modes_questions,
        modes_chunk_tokens=tuple(args.modes_chunk_tokens),
        rrf_ks=tuple(args.rrf_ks),
    )
    if args.json is None:
        print(_format(result))
    elif args.json == "-":
        print(json.dumps(result, indent=2))
    else:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        path.with_suffix(".md").write_text(_format(result) + "\n")
        if result.get("modes"):
            from kvfuse.bench.retrieval_modes import plot_modes

            plot_modes(result["modes"], path.with_suffix(".png"))
        print(_format(result))
    return 0


def _run_e2e(args: argparse.Namespace, settings: Settings) -> int:
    from kvfuse.bench.retrieval_e2e import format_e2e, run_e2e

    result = run_e2e(args.url, resolve_data_dir(args.data_dir, settings), questions=args.modes_questions,
                     top_k=args.top_k, method=args.method, max_tokens=args.max_tokens, api_key=args.api_key,
                     progress=not args.no_progress)
    text = format_e2e(result)
    if args.json and args.json != "-":
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        path.with_suffix(".md").write_text(text + "\n")
    print(json.dumps(result, indent=2) if args.json == "-" else text)
    return 0


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from err
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("sizes must be positive")
    return sizes


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    """Add `kvfuse bench retriever`; import nothing heavy here."""
    p = bench_subparsers.add_parser("retriever", help="embedding throughput, vector search latency, and the "
                                                      "retrieval modes on MuSiQue")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="print the result as JSON (to PATH if given, else stdout; with a PATH, the table goes "
                        "beside it as .md and the modes' plot as .png)")
    p.add_argument("--sizes", type=_sizes, default=[10_000, 100_000],
                   help="corpus sizes in vectors (default 10000,100000)")
    p.add_argument("--queries", type=int, default=200, help="timed queries per index")
    p.add_argument("--max-chunks", type=int, default=None,
                   help="embed at most this many essay chunks (0: skip the embedding figures)")
    p.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
    p.add_argument("--modes-questions", type=int, default=150,
                   help="MuSiQue questions for the retrieval modes (default 150, all; 0: skip that part)")
    p.add_argument("--modes-chunk-tokens", type=csv_list(int), default=[512, 96],
                   help="chunk sizes of the modes' corpus (default 512,96: the default, and ~10k chunks)")
    p.add_argument("--rrf-ks", type=csv_list(int), default=[1, 10, 30, 60, 100],
                   help="RRF k values of the hybrid sweep (default 1,10,30,60,100)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    e2e = p.add_argument_group("end to end through a live server (--url): retrieval, then fusion against vanilla "
                               "on the same retrieved documents, per mode, on --modes-questions questions")
    e2e.add_argument("--url", default=None, help="run only the end-to-end comparison, through this server")
    e2e.add_argument("--api-key", default=None, help="API key for --url")
    e2e.add_argument("--method", default=None, help="the fusion method compared with vanilla (default: the server's)")
    e2e.add_argument("--top-k", type=int, default=TOP_K, help=f"documents retrieved per question (default {TOP_K})")
    e2e.add_argument("--max-tokens", type=int, default=24, help="answer length limit (default 24)")
    p.set_defaults(func=_run)
