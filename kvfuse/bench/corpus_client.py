"""What `kvfuse bench corpus` (corpus.py, corpus_arms.py) asks a server: the trace's questions, one query
naming its documents, the tier counters of /metrics and their differences, and the progress line."""

from __future__ import annotations

import re
import sys
import time
from typing import Any

QUESTIONS = ("What is the main argument here?", "What advice does the author give?",
             "Which examples does the author use?", "What does the author say about startups?",
             "What mistake does the author warn about?", "How does the author define success?")
_METRIC = re.compile(r'^(kvfuse_kv_tier_reads_total|kvfuse_kv_tier_bytes|kvfuse_kv_tier_evictions_total|'
                     r'kvfuse_kv_chunk_sources_total)\{([^}]*)\} ([0-9.eE+-]+)$')


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
