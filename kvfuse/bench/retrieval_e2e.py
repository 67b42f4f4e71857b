"""`kvfuse bench retriever --url`: the retrieval modes end to end through a live server, on MuSiQue.

The passages of the first `questions` MuSiQue questions are ingested into one collection of the server
(each passage one document); each question is then asked over REST in every retrieval mode with the
default fusion method, and asked again with `vanilla` on exactly the documents that retrieval returned,
in the same order: the reference for what fusion changed, separate from what retrieval changed. Per
mode: answer recall@k of the retrieved passages, the answer F1 of the fused and the vanilla answers,
how often the two answers agree, and their TTFT. A retrieved document must be one chunk for the
reference to see the same chunks: run the server with `retriever.chunk_tokens` above the passages'
length (1024 for this sample); questions where the two contexts differ are counted, not hidden.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from kvfuse.bench.agreement import bootstrap_ci
from kvfuse.bench.data import load_musique
from kvfuse.bench.http_backend import checked
from kvfuse.bench.retrieval_modes import say
from kvfuse.bench.scoring import contains, normalize_answer
from kvfuse.bench.scoring import score as score_answer

COLLECTION = "bench-musique"
MODES = ("dense", "keyword", "hybrid")
_BATCH = 16  # documents per ingest request


def run_e2e(url: str, data_dir: Path, *, questions: int, top_k: int = 4, method: str | None = None,
            max_tokens: int = 24, api_key: str | None = None, timeout_s: float = 600.0,
            progress: bool = True) -> dict[str, Any]:
    """Ingest, ask, and return the JSON-ready result (see the module doc). `method`: the fusion method
    compared with vanilla (default: the server's)."""
    import httpx

    items = load_musique(Path(data_dir))[:questions]
    passages = list(dict.fromkeys(p for item in items for p in item.passages))
    ids = {p: f"mq-{i:05d}" for i, p in enumerate(passages)}
    text_of = {v: k for k, v in ids.items()}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s) as http:
        for i in range(0, len(passages), _BATCH):
            docs = [{"id": ids[p], "text": p} for p in passages[i : i + _BATCH]]
            checked(http.post("/v1/documents", params={"wait": "true"},
                          json={"documents": docs, "collection": COLLECTION, "on_conflict": "skip"}))
            say(progress, f"ingested {min(i + _BATCH, len(passages))}/{len(passages)} passages")
        rows: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
        for q, item in enumerate(items):
            for mode in MODES:
                rows[mode].append(_ask(http, item, mode, top_k, method, max_tokens, text_of))
            say(progress, f"asked {q + 1}/{len(items)} questions")
    return {"url": url, "questions": len(items), "passages": len(passages), "top_k": top_k,
            "max_tokens": max_tokens, "method": rows[MODES[0]][0]["method"] if items else method,
            "modes": [_summary(mode, rows[mode]) for mode in MODES], "rows": rows}


def _ask(http: Any, item: Any, mode: str, top_k: int, method: str | None, max_tokens: int,
         text_of: dict[str, str]) -> dict[str, Any]:
    body: dict[str, Any] = {"query": item.question, "top_k": top_k, "max_tokens": max_tokens, "temperature": 0.0,
                            "retrieval": {"mode": mode, "collections": [COLLECTION]}}
    if method:
        body["fusion"] = {"method": method}
    fused = checked(http.post("/v1/query", json=body))
    docs = list(dict.fromkeys(s["document_id"] for s in fused["sources"]))
    answers = list(item.answers)
    row = {"question": item.question, "method": fused["fusion"]["method"], "documents": docs,
           "found": any(contains(text_of[d], a) for d in docs for a in answers), "answer": fused["answer"],
           "f1": score_answer("f1", fused["answer"], answers), "ttft_ms": fused["timings"]["ttft_ms"]}
    resp = http.post("/v1/query", json={"query": item.question, "document_ids": docs, "max_tokens": max_tokens,
                                        "temperature": 0.0, "fusion": {"method": "vanilla"}})
    if resp.status_code == 400 and resp.json()["error"]["code"] == "context_overflow":
        # Whole documents where retrieval took some of their chunks: more than the context holds. No
        # reference for this question (counted in `no_reference`).
        return row | {"vanilla_answer": None}
    ref = checked(resp)
    return row | {
        "vanilla_answer": ref["answer"], "vanilla_f1": score_answer("f1", ref["answer"], answers),
        "same_answer": normalize_answer(fused["answer"]) == normalize_answer(ref["answer"]),
        "same_context": fused["usage"]["context_tokens"] == ref["usage"]["context_tokens"],
        "vanilla_ttft_ms": ref["timings"]["ttft_ms"],
    }


def _summary(mode: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Means with bootstrap intervals; the comparisons with vanilla over the rows that have a reference."""
    paired = [r for r in rows if r["vanilla_answer"] is not None]

    def mean_ci(key: str, over: list[dict[str, Any]]) -> tuple[float | None, list[float] | None]:
        vals = [float(r[key]) for r in over]
        ci = bootstrap_ci(vals)
        return (round(statistics.fmean(vals), 4) if vals else None), ([round(x, 4) for x in ci] if ci else None)

    out: dict[str, Any] = {"mode": mode, "n": len(rows), "no_reference": len(rows) - len(paired)}
    for key in ("found", "f1"):
        out[key], out[f"{key}_ci"] = mean_ci(key, rows)
    for key in ("vanilla_f1", "same_answer", "same_context"):
        out[key], out[f"{key}_ci"] = mean_ci(key, paired)
    for r in paired:
        r["f1_minus_vanilla"] = r["f1"] - r["vanilla_f1"]
    out["f1_minus_vanilla"], out["f1_minus_vanilla_ci"] = mean_ci("f1_minus_vanilla", paired)
    ttft = [r["ttft_ms"] for r in paired]
    ref = [r["vanilla_ttft_ms"] for r in paired]
    out["ttft_ms_median"] = statistics.median(ttft) if ttft else None
    out["vanilla_ttft_ms_median"] = statistics.median(ref) if ref else None
    out["ttft_vs_vanilla"] = (round(out["ttft_ms_median"] / out["vanilla_ttft_ms_median"], 3)
                              if ttft and out["vanilla_ttft_ms_median"] else None)
    return out


def format_e2e(result: dict[str, Any]) -> str:
    def ci(v: list[float] | None) -> str:
        return f" [{v[0]:.2f}, {v[1]:.2f}]" if v else ""

    def num(v: float | None, fmt: str) -> str:
        return "–" if v is None else format(v, fmt)

    lines = [
        f"End to end through {result['url']}: {result['questions']} MuSiQue questions over their "
        f"{result['passages']} passages, top {result['top_k']}, `{result['method']}` against `vanilla` on the "
        "same retrieved documents",
        "",
        "| mode | answer in retrieved | F1 | vanilla F1 | F1 − vanilla | same answer | same context | "
        "no reference | TTFT ms (median) | vs vanilla |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in result["modes"]:
        lines.append(f"| {m['mode']} | {m['found']:.2f}{ci(m['found_ci'])} | {m['f1']:.3f}{ci(m['f1_ci'])} | "
                     f"{num(m['vanilla_f1'], '.3f')}{ci(m['vanilla_f1_ci'])} | "
                     f"{num(m['f1_minus_vanilla'], '+.3f')}{ci(m['f1_minus_vanilla_ci'])} | "
                     f"{num(m['same_answer'], '.2f')}{ci(m['same_answer_ci'])} | {num(m['same_context'], '.2f')} | "
                     f"{m['no_reference']} | {num(m['ttft_ms_median'], '.0f')} | {m['ttft_vs_vanilla']} |")
    return "\n".join(lines)


