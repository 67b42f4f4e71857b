"""`kvfuse bench ingest`: what `store.precompute_at: first_use` buys and costs, through a real server's HTTP
API, in one run (docs/DESIGN.md, "KV when it pays").

One server (`kvfuse serve` on a free loopback port with a fresh data dir, its settings from the
environment, its RAM and device tiers off: `COLD_ENV`): the same essay openings are ingested with
`precompute_at: first_use` (ready once chunked, embedded and indexed), deleted (their blobs with them) and
ingested with first_use again, then deleted and ingested with `ingest` (every chunk's KV computed before
ready); `run` lists the queries of each phase. Per document one query names it (`document_ids`), so
every chunk of a first-use document is cold at its first query:

- ingest seconds of each mode over the same documents (the targets: first_use <= 0.2x ingest's);
- TTFT of the first query over each first-use document, all its chunks cold, both ways `fusion.cold_chunks`
  offers: `compute` (computed within the query after their recorded contexts) and the default `auto` (a
  full prefill when that is sooner, the chunks computed after it at ingestion's share); of the same query
  with `vanilla` (a full prefill: no stored KV at all); again after each first query (its chunks now
  read); and over the eagerly ingested document (warm);
- whether each answer over first-use chunks is the one over the eagerly ingested chunks, token for token,
  and auto's cold answer vanilla's.

TTFT is the server's (`timings.ttft_ms`: arrival to first token). A first-use query's TTFT against
vanilla's is the ratio the targets name (within 1.3x). The plot (the optional extra `kvfuse[bench]`)
shows the ingest times and the six TTFTs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from kvfuse.bench.plots import plot_if_possible

QUESTION = "What is the main point of this essay?"
# The worker's RAM and device tiers off: a deleted document's blobs would stay cached there (content-addressed,
# still correct KV), so the documents ingested again would not start cold; the chunks are read from LMDB.
COLD_ENV = {"KVFUSE_STORE__HOT_TIER_MB": "0", "KVFUSE_STORE__DEVICE_TIER_MB": "0"}


def _docs(data_dir: Path, n: int, chars: int) -> list[tuple[str, str]]:
    from kvfuse.bench.data import load_essays

    out = []
    for name, text in load_essays(data_dir)[:n]:
        cut = text[:chars]
        out.append((f"fu-{name}", cut[: cut.rfind(" ")] if " " in cut and len(text) > chars else cut))
    return out


def _ingest(c: Any, docs: list[tuple[str, str]], mode: str) -> float:
    t0 = time.perf_counter()
    resp = c.post("/v1/documents?wait=true", json={"documents": [
        {"id": d, "text": t, "precompute_at": mode, "on_conflict": "overwrite"} for d, t in docs]})
    resp.raise_for_status()
    seconds = time.perf_counter() - t0
    assert all(d["status"] == "ready" for d in resp.json()["documents"]), resp.text
    return seconds


def _ask(c: Any, doc_id: str, method: str | None = None, max_tokens: int | None = None,
         cold_chunks: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"query": QUESTION, "document_ids": [doc_id]}
    if max_tokens:
        body["max_tokens"] = max_tokens
    fusion = {k: v for k, v in (("method", method), ("cold_chunks", cold_chunks)) if v}
    if fusion:
        body["fusion"] = fusion
    resp = c.post("/v1/query", json=body)
    resp.raise_for_status()
    a = resp.json()
    return {"ttft_ms": a["timings"]["ttft_ms"], "kv_compute_ms": a["timings"].get("kv_compute_ms", 0.0),
            "chunks_computed": a["usage"].get("chunks_computed"), "chunks_deferred": a["usage"].get("chunks_deferred"),
            "method": a["fusion"]["method"], "answer": a["answer"]}


def _wait_for_kv(c: Any, doc_id: str, chunks: int, timeout_s: float) -> float:
    """Seconds until every chunk of the document holds KV (a deferred computation stored them)."""
    t0 = time.perf_counter()
    while c.get(f"/v1/documents/{doc_id}").json()["kv_chunks"] < chunks:
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"{doc_id}: its chunks' KV was not stored within {timeout_s} s")
        time.sleep(0.2)
    return time.perf_counter() - t0


def run(url: str, docs: list[tuple[str, str]], timeout_s: float = 1800, max_tokens: int | None = None) -> dict[str, Any]:
    """The phases against the server at `url`; the rows per document and the summary. `max_tokens`: the
    answers' budget (None: the server's `generation.max_tokens`).

    1. first_use ingestion (timed); per document the first query with `fusion.cold_chunks: compute` (every
       chunk computed in its prefill after its recorded context), the same query with `vanilla`, and again
       (its chunks now read);
    2. the documents deleted and ingested again with first_use; per document the first query with the
       default `cold_chunks` (auto: a full prefill when that is sooner, the chunks computed after it), the
       seconds until its chunks hold KV, and the query again (reading them);
    3. the documents deleted and ingested eagerly (timed); per document the query over its stored chunks."""
    import functools

    import httpx

    q = functools.partial(_ask, max_tokens=max_tokens)
    rows = {d: {"document": d} for d, _ in docs}
    with httpx.Client(base_url=url, timeout=timeout_s) as c:
        first_use_s = _ingest(c, docs, "first_use")
        for d, _ in docs:
            rows[d]["chunks"] = c.get(f"/v1/documents/{d}").json()["chunks"]
            rows[d]["cold"] = q(c, d, cold_chunks="compute")
            rows[d]["vanilla"] = q(c, d, "vanilla")
            rows[d]["after_warm_up"] = q(c, d)
        for d, _ in docs:
            c.delete(f"/v1/documents/{d}").raise_for_status()
        _ingest(c, docs, "first_use")
        for d, _ in docs:
            rows[d]["cold_auto"] = q(c, d)
            rows[d]["deferred_s"] = round(_wait_for_kv(c, d, rows[d]["chunks"], timeout_s), 2)
            rows[d]["after_auto"] = q(c, d)
        for d, _ in docs:
            c.delete(f"/v1/documents/{d}").raise_for_status()
        ingest_s = _ingest(c, docs, "ingest")
        for d, _ in docs:
            rows[d]["warm"] = q(c, d)
    return {"summary": _summary(rows, first_use_s, ingest_s), "rows": list(rows.values())}


def _summary(rows: dict[str, dict[str, Any]], first_use_s: float, ingest_s: float) -> dict[str, Any]:
    med = lambda key: statistics.median(r[key]["ttft_ms"] for r in rows.values())  # noqa: E731
    over_vanilla = lambda key: round(statistics.median(  # noqa: E731
        r[key]["ttft_ms"] / r["vanilla"]["ttft_ms"] for r in rows.values()), 3)
    same = lambda a, b: sum(r[a]["answer"] == r[b]["answer"] for r in rows.values())  # noqa: E731
    return {
        "documents": len(rows), "chunks": sum(r["chunks"] for r in rows.values()),
        "ingest_s": {"first_use": round(first_use_s, 2), "ingest": round(ingest_s, 2),
                     "ratio": round(first_use_s / ingest_s, 3)},
        "ttft_ms_median": {k: round(med(k), 1) for k in ("cold", "cold_auto", "vanilla", "after_warm_up",
                                                          "after_auto", "warm")},
        "cold_over_vanilla": over_vanilla("cold"),
        "cold_auto_over_vanilla": over_vanilla("cold_auto"),
        "cold_auto_methods": sorted({r["cold_auto"]["method"] for r in rows.values()}),
        "deferred_s_median": statistics.median(r["deferred_s"] for r in rows.values()),
        "answers_same_as_eager": same("cold", "warm"),
        "cold_auto_same_as_vanilla": same("cold_auto", "vanilla"),
        "after_auto_same_as_eager": same("after_auto", "warm"),
        "after_warm_up_computed": sum(r["after_warm_up"]["chunks_computed"] or 0 for r in rows.values()),
        "after_auto_computed": sum(r["after_auto"]["chunks_computed"] or 0 for r in rows.values()),
    }


def render(result: dict[str, Any], command: str) -> str:
    s = result["summary"]
    t = s["ttft_ms_median"]
    n = s["documents"]
    lines = [
        "# First use against eager ingestion", "", f"Command: `{command}`", "",
        f"{n} documents, {s['chunks']} chunks; one query per document naming it.", "",
        "| | first_use | ingest | ratio |", "|---|---|---|---|",
        f"| ingest seconds | {s['ingest_s']['first_use']} | {s['ingest_s']['ingest']} | {s['ingest_s']['ratio']} |", "",
        "| TTFT ms (median over documents) | value | over vanilla |", "|---|---|---|",
        f"| first query, every chunk cold, `cold_chunks: compute` | {t['cold']} | {s['cold_over_vanilla']}x |",
        f"| first query, every chunk cold, `cold_chunks: auto` (default) | {t['cold_auto']} | "
        f"{s['cold_auto_over_vanilla']}x |",
        f"| vanilla (full prefill) | {t['vanilla']} | 1.0x |",
        f"| the same query after the first (compute) | {t['after_warm_up']} | |",
        f"| the same query once auto's deferred chunks are stored | {t['after_auto']} | |",
        f"| eagerly ingested (warm) | {t['warm']} | |", "",
        f"auto ran {', '.join(s['cold_auto_methods'])} for the cold queries; their chunks held KV a median "
        f"{s['deferred_s_median']} s after the answer. Chunks computed by the queries after the first: "
        f"{s['after_warm_up_computed']} (compute), {s['after_auto_computed']} (auto). Answers the same as over "
        f"eager chunks: {s['answers_same_as_eager']} of {n} (cold, compute), {s['after_auto_same_as_eager']} of "
        f"{n} (after auto's deferred chunks); auto's cold answers the same as vanilla's: "
        f"{s['cold_auto_same_as_vanilla']} of {n}.", "",
        "| document | chunks | cold compute | cold auto | vanilla | after | after auto | warm | cold kv_compute ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['document']} | {r['chunks']} | {r['cold']['ttft_ms']} | {r['cold_auto']['ttft_ms']} | "
                     f"{r['vanilla']['ttft_ms']} | {r['after_warm_up']['ttft_ms']} | {r['after_auto']['ttft_ms']} | "
                     f"{r['warm']['ttft_ms']} | {r['cold']['kv_compute_ms']} |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    from kvfuse.bench.plots import pyplot

    plt = pyplot()
    s = result["summary"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [1, 2.2]})
    a.bar(["first_use", "ingest"], [s["ingest_s"]["first_use"], s["ingest_s"]["ingest"]], color=["tab:green", "tab:blue"])
    a.set_ylabel("seconds")
    a.set_title(f"ingest, {s['documents']} documents ({s['chunks']} chunks)")
    t = s["ttft_ms_median"]
    names = ["cold\ncompute", "cold\nauto", "vanilla", "after\ncompute", "after\nauto", "eager\n(warm)"]
    keys = ["cold", "cold_auto", "vanilla", "after_warm_up", "after_auto", "warm"]
    b.bar(names, [t[k] for k in keys], color=["tab:orange", "tab:red", "tab:gray", "tab:green", "tab:olive", "tab:blue"])
    b.set_ylabel("TTFT ms (median)")
    b.set_title("one query per document")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def command(args: argparse.Namespace) -> int:
    from kvfuse.bench.data import resolve_data_dir
    from kvfuse.bench.load import LocalServer
    from kvfuse.bench.machine import command_line, load_info, machine_info

    docs = _docs(resolve_data_dir(args.data_dir), args.documents, args.chars)
    if args.url:
        result = run(args.url, docs, max_tokens=args.max_tokens)
    else:
        with LocalServer(env=COLD_ENV) as server:
            result = run(server.url, docs, max_tokens=args.max_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = command_line("kvfuse bench ingest", args.parser, args)
    result |= {"command": cmd, "machine": machine_info(), "load": load_info()}
    (out / "first-use.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    (out / "first-use.md").write_text(render(result, cmd), encoding="utf-8")
    plot_if_possible(plot, result, out / "first-use.png")
    print(json.dumps(result["summary"], indent=1))
    return 0


def register(bsub: Any) -> None:
    """Add `kvfuse bench ingest` (imports nothing heavy)."""
    from kvfuse.bench.data import DATA_DIR_HELP

    p = bsub.add_parser("ingest", help="precompute_at first_use against ingest: ingest time, cold/warm TTFT, vanilla")
    p.add_argument("--documents", type=int, default=6, help="essay openings ingested (one query each)")
    p.add_argument("--chars", type=int, default=2400, help="characters of each essay's opening")
    p.add_argument("--max-tokens", type=int, default=None, help="answer budget (default: generation.max_tokens)")
    p.add_argument("--url", default=None, help="measure this server instead of starting one (it must be empty of them)")
    p.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
    p.add_argument("--out", default="docs/results/first-use", help="folder of first-use.json, .md and .png")
    p.set_defaults(func=command, parser=p)
