"""`kvfuse bench retriever`, retrieval modes: dense, keyword and hybrid on MuSiQue's questions over all of
its passages as one corpus.

Every passage of the sample (deduplicated) is a document, chunked by the service's chunker at each
`chunk_tokens` given (the default size, and a smaller one that makes about ten thousand chunks for the
latency target). For each question and mode the top 10 chunks are retrieved through the same function the
service calls (`kvfuse.retriever.hybrid.search`), question embedding included. Per mode: answer recall@k
(a gold answer, or an alias, appears as whole words in one of the top k chunks, case-insensitive), MRR@10
over the first such chunk, query latency p50/p95, and the indexes' build time and size on disk. Paired
bootstrap intervals over questions compare hybrid with each single mode; the hybrid rows are repeated for
several RRF k.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvfuse.bench.agreement import bootstrap_ci
from kvfuse.bench.data import load_musique
from kvfuse.bench.load import percentile
from kvfuse.bench.scoring import contains
from kvfuse.retriever.hybrid import MODES

KS = (1, 4, 10)
DEPTH = max(KS)
TIMED_PASSES = 3  # each question is timed this often per mode (modes interleaved), medians of the passes


def run_modes_bench(settings: Any, embedder: Any, data_dir: Path, *, questions: int, chunk_tokens: tuple[int, ...],
                    rrf_ks: tuple[int, ...], progress: bool) -> list[dict[str, Any]]:
    """One result per chunk size (see the module doc)."""
    from kvfuse.model_files import resolve_llm
    from kvfuse.retriever import Chunker

    items = load_musique(Path(data_dir))
    asked = items[:questions]
    # The corpus is every passage of the sample, whatever the number of questions asked (fewer: a test).
    pool = items if questions >= len(items) else asked
    passages = list(dict.fromkeys(p for item in pool for p in item.passages))
    out = []
    for tokens in chunk_tokens:
        chunker = Chunker.from_pretrained(resolve_llm(settings.model.llm, settings.models_dir), tokens)
        docs = {f"p{i:05d}": [c.text for c in chunker.chunk(text)] for i, text in enumerate(passages)}
        out.append(_one_size(settings, embedder, docs, asked, tokens, rrf_ks, progress))
    return out


def _one_size(settings: Any, embedder: Any, docs: dict[str, list[str]], asked: Any, chunk_tokens: int,
              rrf_ks: tuple[int, ...], progress: bool) -> dict[str, Any]:
    from kvfuse.retriever import VectorIndex
    from kvfuse.retriever.hybrid import search
    from kvfuse.retriever.keyword_index import KeywordIndex

    rs = settings.retriever
    texts = [t for chunks in docs.values() for t in chunks]
    say(progress, f"chunks of <= {chunk_tokens} tokens: {len(texts)} from {len(docs)} passages; embedding")
    with tempfile.TemporaryDirectory(prefix="kvfuse-bench-modes-") as tmp:
        t0 = time.perf_counter()
        vectors = embedder.embed(texts)
        embed_s = time.perf_counter() - t0
        dense = VectorIndex.open(Path(tmp) / "faiss", embedder.dim, rs)
        t0, row = time.perf_counter(), 0
        for doc, chunks in docs.items():
            dense.add(doc, vectors[row : row + len(chunks)])
            row += len(chunks)
        faiss_s = time.perf_counter() - t0
        keyword = KeywordIndex.open(Path(tmp) / "kw", rs)
        t0 = time.perf_counter()
        for doc, chunks in docs.items():  # as ingestion adds them: fresh rows, merges when due
            keyword.add(doc, chunks)
        incremental_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        keyword.rebuild(docs.items())
        rebuild_s = time.perf_counter() - t0
        dense.save()
        keyword.save()
        sizes = {name: sum(p.stat().st_size for p in (Path(tmp) / name).iterdir()) for name in ("faiss", "kw")}

        def embed(q: str) -> Any:
            return embedder.embed([q])[0]

        def run(mode: str, question: str, k: int = rs.rrf_k) -> list[Any]:
            return search(mode, question, DEPTH, embed=embed, dense=dense, keyword=keyword, rrf_k=k,
                          candidates=rs.candidates)

        chunk_text = {(d, i): t for d, chunks in docs.items() for i, t in enumerate(chunks)}
        first = {m: [_first_answer(run(m, it.question), it.answers, chunk_text) for it in asked] for m in MODES}
        for it in asked[:10]:  # warm-up: first calls pay for lazy initialization
            for m in MODES:
                run(m, it.question)
        latency: dict[str, list[float]] = {m: [] for m in MODES}
        for p in range(TIMED_PASSES):
            for it in asked:
                for m in MODES[p % len(MODES):] + MODES[: p % len(MODES)]:  # rotate the order between passes
                    t0 = time.perf_counter()
                    run(m, it.question)
                    latency[m].append((time.perf_counter() - t0) * 1000)
        sweep = {k: [_first_answer(run("hybrid", it.question, k), it.answers, chunk_text) for it in asked]
                 for k in rrf_ks}
    rows = [_mode_row(m, first[m], latency[m]) for m in MODES]
    build = {"dense": {"embed_s": round(embed_s, 2), "faiss_add_s": round(faiss_s, 3), "disk_bytes": sizes["faiss"]},
             "keyword": {"incremental_s": round(incremental_s, 3), "rebuild_s": round(rebuild_s, 3),
                         "disk_bytes": sizes["kw"], "terms": keyword.segments()["terms"]}}
    return {
        "chunk_tokens": chunk_tokens, "passages": len(docs), "chunks": len(texts), "questions": len(asked),
        "index_type": rs.index_type, "rrf_k": rs.rrf_k, "candidates": rs.candidates, "build": build, "modes": rows,
        "paired_recall_at_4": {f"hybrid-{m}": _paired(first["hybrid"], first[m], 4) for m in ("dense", "keyword")},
        "latency_ratio_hybrid_dense_p50": round(rows[2]["latency_p50_ms"] / rows[0]["latency_p50_ms"], 3),
        "rrf_k_sweep": [{"rrf_k": k, **_quality(ranks)} for k, ranks in sweep.items()],
    }


def _first_answer(hits: list[Any], answers: tuple[str, ...], chunk_text: dict) -> int | None:
    """Rank (from 1) of the first hit whose text holds a gold answer; None if none of them does."""
    for rank, h in enumerate(hits, 1):
        text = chunk_text[(h.document_id, h.chunk_index)]
        if any(contains(text, a) for a in answers):
            return rank
    return None


def _quality(first: list[int | None]) -> dict[str, Any]:
    n = len(first)
    out: dict[str, Any] = {}
    for k in KS:
        hits = [1.0 if r is not None and r <= k else 0.0 for r in first]
        ci = bootstrap_ci(hits)
        out[f"recall_at_{k}"] = round(sum(hits) / n, 4)
        out[f"recall_at_{k}_ci"] = [round(x, 4) for x in ci] if ci else None
    out["mrr_at_10"] = round(sum(1.0 / r for r in first if r is not None) / n, 4)
    return out


def _mode_row(mode: str, first: list[int | None], latency_ms: list[float]) -> dict[str, Any]:
    return {"mode": mode, **_quality(first), "latency_p50_ms": round(statistics.median(latency_ms), 3),
            "latency_p95_ms": round(percentile(latency_ms, 95), 3), "timed_queries": len(latency_ms)}


def _paired(a: list[int | None], b: list[int | None], k: int) -> dict[str, Any]:
    """Mean of the per-question difference in recall@k (a − b), with its bootstrap interval."""
    diff = [float(x is not None and x <= k) - float(y is not None and y <= k) for x, y in zip(a, b, strict=True)]
    ci = bootstrap_ci(diff)
    return {"mean": round(sum(diff) / len(diff), 4), "ci": [round(x, 4) for x in ci] if ci else None,
            "wins": sum(d > 0 for d in diff), "losses": sum(d < 0 for d in diff)}


def say(progress: bool, text: str) -> None:
    if progress:
        print(text, file=sys.stderr, flush=True)


def format_modes(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        b = r["build"]
        lines += [
            f"### {r['chunks']:,} chunks of <= {r['chunk_tokens']} tokens ({r['passages']} passages, "
            f"{r['questions']} questions; FAISS {r['index_type']}, RRF k = {r['rrf_k']}, {r['candidates']} candidates)",
            "",
            "| mode | recall@1 | recall@4 [95% CI] | recall@10 | MRR@10 | p50 ms | p95 ms |",
            "|---|---|---|---|---|---|---|",
        ]
        for m in r["modes"]:
            ci = m["recall_at_4_ci"]
            lines.append(f"| {m['mode']} | {m['recall_at_1']:.3f} | {m['recall_at_4']:.3f} "
                         f"[{ci[0]:.3f}, {ci[1]:.3f}] | {m['recall_at_10']:.3f} | {m['mrr_at_10']:.3f} | "
                         f"{m['latency_p50_ms']:.2f} | {m['latency_p95_ms']:.2f} |")
        lines.append("")
        for name, p in r["paired_recall_at_4"].items():
            lines.append(f"- recall@4, {name}: {p['mean']:+.3f} [{p['ci'][0]:+.3f}, {p['ci'][1]:+.3f}] "
                         f"({p['wins']} questions gained, {p['losses']} lost)")
        lines.append(f"- hybrid p50 latency / dense p50 latency: {r['latency_ratio_hybrid_dense_p50']:.2f}")
        lines.append(f"- build: embedding {b['dense']['embed_s']} s + FAISS add {b['dense']['faiss_add_s']} s "
                     f"({b['dense']['disk_bytes']:,} bytes); keyword index {b['keyword']['incremental_s']} s added "
                     f"document by document, {b['keyword']['rebuild_s']} s rebuilt at once "
                     f"({b['keyword']['disk_bytes']:,} bytes, {b['keyword']['terms']:,} terms)")
        lines += ["", "| RRF k | recall@1 | recall@4 | recall@10 | MRR@10 |", "|---|---|---|---|---|"]
        for s in r["rrf_k_sweep"]:
            lines.append(f"| {s['rrf_k']} | {s['recall_at_1']:.3f} | {s['recall_at_4']:.3f} | "
                         f"{s['recall_at_10']:.3f} | {s['mrr_at_10']:.3f} |")
        lines.append("")
    return "\n".join(lines)


def plot_modes(results: list[dict[str, Any]], path: Path) -> Path:
    """Recall@k per mode with the recall@4 interval, and latency p50/p95, one row of panels per chunk size."""
    from kvfuse.bench.plots import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(len(results), 2, figsize=(11, 3.6 * len(results)), squeeze=False)
    for (ax_q, ax_t), r in zip(axes, results, strict=True):
        width = 0.25
        for j, m in enumerate(r["modes"]):
            xs = [i + (j - 1) * width for i in range(len(KS))]
            vals = [m[f"recall_at_{k}"] for k in KS]
            errs = [[0, 0, 0], [0, 0, 0]]
            ci = m["recall_at_4_ci"]
            errs[0][1], errs[1][1] = m["recall_at_4"] - ci[0], ci[1] - m["recall_at_4"]
            ax_q.bar(xs, vals, width, yerr=errs, capsize=3, label=m["mode"])
        ax_q.set_xticks(range(len(KS)), [f"recall@{k}" for k in KS])
        ax_q.set_ylim(0, 1)
        ax_q.set_title(f"answer recall, {r['chunks']:,} chunks of <= {r['chunk_tokens']} tokens")
        ax_q.legend(loc="upper left")
        names = [m["mode"] for m in r["modes"]]
        ax_t.bar([i - 0.2 for i in range(3)], [m["latency_p50_ms"] for m in r["modes"]], 0.4, label="p50")
        ax_t.bar([i + 0.2 for i in range(3)], [m["latency_p95_ms"] for m in r["modes"]], 0.4, label="p95")
        ax_t.set_xticks(range(3), names)
        ax_t.set_ylabel("ms per query (embedding included)")
        ax_t.set_title("query latency")
        ax_t.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
