"""`kvfuse calibrate --target T`: the ratio to hold before any traffic, measured on the ingested corpus.

It runs a file of queries (JSON lines: `query`, and `document_ids` or nothing to retrieve as the service
does), or a sample of the service's query log (`fidelity.query_log`, rag/query_log.py), against the store
in `data_dir`, its chunks picked by the service's own code (rag/sources.py), the way the worker answers
them: each chunk's stored KV (rebuilt
from its tokens if missing), fused by the method at each ratio of a ladder, decoded greedily; and once
as a full prefill. Per method, prompt-size bucket and ratio it measures the agreement with the full
prefill's answer (`fidelity.metric`, with its 95 % Wilson interval), the answer KL of the fused answer
under the full prefill (teacher forced, as the live shadow checks measure it: worker/shadow.py) and
TTFT. For each method and bucket it picks the smallest ratio whose interval's lower end meets T, and
writes it into the state `serve` loads (`fidelity.state_file`, stamped with the model's fingerprint):
see docs/usage.md, "The quality contract". Table and plot: calibrate_report.py.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class CalQuery:
    """A question and what picks its chunks: its documents, or a retrieval (None: the configured
    defaults) as the service ran it."""

    query: str
    document_ids: list[str] | None = None
    system_prompt: str | None = None
    collections: list[str] | None = None
    filters: dict | None = None
    top_k: int | None = None
    retrieval_mode: str | None = None


@dataclass
class Cell:
    """One method, bucket and ratio: per query, agreement, answer KL and TTFT."""

    agreed: list[bool] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)


def read_queries(path: Path) -> list[CalQuery]:
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out.append(CalQuery(row["query"], row.get("document_ids"), row.get("system_prompt")))
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}:{n}: expected a JSON object with `query` ({err})") from None
    if not out:
        raise ValueError(f"{path}: no queries")
    return out


def queries_from_log(settings: Any, sample: int, seed: int) -> list[CalQuery]:
    """`sample` entries of the query log in `data_dir`, drawn uniformly (seeded), all when it holds fewer.
    ValueError when the log is off or empty."""
    import random

    from kvfuse.service.rag.query_log import log_path, read_log

    fid = settings.fidelity
    if not fid.query_log:
        raise ValueError("the query log is off (fidelity.query_log): turn it on for `serve`, let it collect "
                         "queries, or pass --queries FILE")
    path = log_path(settings)
    rows = read_log(path, fid.query_log_size)
    if not rows:
        raise ValueError(f"the query log {path} is empty: let `serve` answer queries first, or pass --queries FILE")
    if sample < len(rows):
        rows = random.Random(seed).sample(rows, sample)
    return [CalQuery(r["question"], r.get("document_ids"), r.get("system_prompt"), r.get("collections"),
                     r.get("filters"), r.get("top_k"), r.get("retrieval_mode")) for r in rows]


class Calibration:
    """The engine, the store and the corpus of `settings`, loaded once."""

    def __init__(self, settings: Any, max_tokens: int) -> None:
        from kvfuse.bench.engine_backend import EngineBackend
        from kvfuse.model_files import resolve_llm
        from kvfuse.retriever import Chunker
        from kvfuse.service.rag.corpus import Corpus
        from kvfuse.service.worker.chunk_kv import ChunkCache
        from kvfuse.store import KVStore

        self.settings = settings
        self.max_tokens = max_tokens
        self.backend = EngineBackend(settings, max_tokens=max_tokens)
        self.engine = self.backend.engine
        self.store = KVStore.open(settings)
        self.corpus = Corpus(settings, self.store)
        self.corpus.chunker = Chunker.from_pretrained(resolve_llm(settings.model.llm, settings.models_dir),
                                                      settings.retriever.chunk_tokens)
        self.kv = ChunkCache(self.engine, self.store, settings)
        self._retrieval_loaded = False

    def close(self) -> None:
        self.store.close()

    def chunks(self, q: CalQuery) -> list[Any]:
        """The query's chunks (rag/sources.py `SourceChunk`), named or retrieved, picked by the service's
        own code: keyed for the running model, rendered and ordered as the prompt has them
        (`model.prompt_layout`, `model.prompt_order`)."""
        import dataclasses

        from kvfuse.service.rag.retrieval import retrieval_options
        from kvfuse.service.rag.sources import chunk_key_now, document_source_chunks, searched_source_chunks

        fp, dtype = self.engine.fingerprint, self.settings.store.kv_dtype

        def key(rec: Any, i: int, ids: list[int]) -> str:
            return chunk_key_now(fp, dtype, rec, i, ids)

        if q.document_ids is not None:
            chunks = []
            for doc_id in q.document_ids:
                rec = self.store.get_document(doc_id)
                if rec is None or rec.status != "ready":
                    raise ValueError(f"document {doc_id!r} is not ready in {self.settings.data_dir}")
                chunks.extend(document_source_chunks(self.corpus, rec, key))
            return chunks
        if not self._retrieval_loaded:
            self.corpus.load()
            self._retrieval_loaded = True
        s = self.settings
        opts = retrieval_options(s, None)
        opts = dataclasses.replace(opts, collections=q.collections, mode=q.retrieval_mode or opts.mode)
        chunks = searched_source_chunks(self.corpus, q.query, q.top_k or s.retriever.top_k, opts, q.filters, key,
                                        s.model.prompt_order)
        if not chunks:
            raise ValueError(f"no ready document in {s.data_dir} matches {q.query!r}")
        return chunks

    def run(self, q: CalQuery, chunks: list[Any], methods: list[str], ratios: list[float], metric: str
            ) -> tuple[int, float, dict[tuple[str, float], tuple[bool, float, float]]]:
        """Over the query's `chunks` (`chunks(q)`): (context tokens, the full prefill's TTFT,
        {(method, ratio): (agreed, answer KL, TTFT)})."""
        from kvfuse.answer_match import same_answer
        from kvfuse.fusion import ChunkKV
        from kvfuse.fusion.teacher_forcing import answer_kl, teacher_forced_logits

        e, be = self.engine, self.backend
        system = q.system_prompt if q.system_prompt is not None else self.settings.model.system_prompt
        names = [c.name for c in chunks]
        prefix_ids, question_ids = e.prompt_parts(q.query, system, names, self.settings.model.prompt_layout)
        full = be.greedy(ChunkKV(prefix_ids), [ChunkKV(c.token_ids) for c in chunks], question_ids,
                         be.options("vanilla", None), self.max_tokens)
        stored = [self.kv.load_or_rebuild(c.key, c.token_ids, context=c.context)[0] for c in chunks]
        prefix = self.kv.prefixes.get(prefix_ids)
        out = {}
        for method in methods:
            for r in ratios:
                ans = be.greedy(prefix, stored, question_ids, be.options(method, r), self.max_tokens, keep_steps=True)
                logits = teacher_forced_logits(e, full.fused, ans.tokens)
                out[(method, r)] = (same_answer(ans.text, full.text, metric), answer_kl(logits, ans.steps), ans.ttft_s)
        return sum(len(c.token_ids) for c in chunks), full.ttft_s, out


def calibrate(settings: Any, queries: list[CalQuery], methods: list[str], ratios: list[float], target: float,
              max_tokens: int, progress: bool = True) -> dict[str, Any]:
    """Measure every query at every ratio; the cells and the full prefill's TTFTs per bucket. A query whose
    chunks cannot be picked any more (its documents deleted since it was logged, say) is skipped, with a
    warning (`queries` counts those measured)."""
    from tqdm import tqdm

    from kvfuse.service.errors import APIError
    from kvfuse.service.rag.fidelity_control import size_bucket

    cal = Calibration(settings, max_tokens)
    cells: dict[tuple[str, str, float], Cell] = {}
    full_ttft: dict[str, list[float]] = {}
    measured = 0
    try:
        for q in tqdm(queries, desc="calibrate", unit="query", disable=not progress):
            try:
                chunks = cal.chunks(q)
            except (ValueError, APIError) as err:
                log.warning("calibrate: skipped %r: %s", q.query[:80], err)
                continue
            ctx, t_full, results = cal.run(q, chunks, methods, ratios, settings.fidelity.metric)
            measured += 1
            bucket = size_bucket(ctx, settings.fidelity.size_buckets)
            full_ttft.setdefault(bucket, []).append(t_full)
            for (method, r), (agreed, kl, ttft) in results.items():
                cell = cells.setdefault((method, bucket, r), Cell())
                cell.agreed.append(agreed)
                cell.kl.append(kl)
                cell.ttft_s.append(ttft)
        fingerprint = cal.engine.fingerprint
    finally:
        cal.close()
    return {"target": target, "metric": settings.fidelity.metric, "ratios": ratios, "methods": methods,
            "fingerprint": fingerprint, "queries": measured, "max_tokens": max_tokens,
            "cells": cells, "full_ttft_s": full_ttft}


def choose(run: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per method and bucket: the smallest ratio whose interval's lower end meets the target (or the
    largest ratio tried, `met: False`, when none does), with its counts."""
    from kvfuse.service.rag.fidelity_control import wilson

    out = {}
    keys = sorted({(m, b) for m, b, _ in run["cells"]})
    for method, bucket in keys:
        pick = None
        for r in sorted(run["ratios"]):
            cell = run["cells"][(method, bucket, r)]
            lo, _ = wilson(sum(cell.agreed), len(cell.agreed))
            pick = {"ratio": r, "checks": len(cell.agreed), "agreements": sum(cell.agreed), "lower": lo,
                    "met": lo >= run["target"]}
            if pick["met"]:
                break
        out[(method, bucket)] = pick
    return out


def write_state(settings: Any, run: dict[str, Any], picks: dict[tuple[str, str], dict[str, Any]]) -> Path:
    """The picks as the controller's holds, in the state `serve` loads; returns its path."""
    import dataclasses

    from kvfuse.service.rag.fidelity import load_state, save_state, state_path
    from kvfuse.service.rag.fidelity_control import Hold, Policy, RatioController

    fid = settings.fidelity
    policy = dataclasses.replace(Policy.from_settings(fid), target=run["target"])
    controller = RatioController(policy, settings.fusion.recompute_ratio)
    path = state_path(settings)
    saved = load_state(path, run["fingerprint"])
    if saved is not None:
        controller.load(saved)  # holds of other methods or buckets stay
    for (method, bucket), p in picks.items():
        ratio = controller.snap(p["ratio"])
        same = abs(ratio - p["ratio"]) <= 1e-6
        controller.holds[(method, bucket)] = Hold(ratio, p["checks"] if same else 0, p["agreements"] if same else 0)
    save_state(path, run["fingerprint"], controller, run["metric"],
               calibrated={"queries": run["queries"], "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return path
