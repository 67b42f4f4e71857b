"""`kvfuse bench ingest`: what `store.precompute_at: first_use` buys and costs, through a real server's HTTP
API, in one run (docs/DESIGN.md, "KV when it pays").

One server (`kvfuse serve` on a free loopback port with a fresh data dir, its settings from the
environment): the same essay openings are ingested twice, first with `precompute_at: first_use` (ready
once chunked, embedded and indexed), then, once those documents are deleted (their blobs with them), with
`ingest` (every chunk's KV computed before ready). Per document one query names it
(`document_ids`), so every chunk of a first-use document is cold at its first query:

- ingest seconds of each mode over the same documents (the targets: first_use <= 0.2x ingest's);
- TTFT of the first query over each first-use document (all its chunks cold, computed within the query
  after their recorded contexts), of the same query with `vanilla` (a full prefill: no stored KV at all)
  and again after that first query (its chunks now read), and over the eagerly ingested document (warm);
- whether each answer over first-use chunks is the one over the eagerly ingested chunks, token for token.

TTFT is the server's (`timings.ttft_ms`: arrival to first token). A first-use query's TTFT against
vanilla's is the ratio the targets name (within 1.3x). The plot (the optional extra `kvfuse[bench]`)
shows the ingest times and the four TTFTs.
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


def _ask(c: Any, doc_id: str, method: str | None = None, max_tokens: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"query": QUESTION, "document_ids": [doc_id]}
    if max_tokens:
        body["max_tokens"] = max_tokens
    if method:
        body["fusion"] = {"method": method}
    resp = c.post("/v1/query", json=body)
    resp.raise_for_status()
    a = resp.json()
    return {"ttft_ms": a["timings"]["ttft_ms"], "kv_compute_ms": a["timings"].get("kv_compute_ms", 0.0),
            "chunks_computed": a["usage"].get("chunks_computed"), "answer": a["answer"]}


def run(url: str, docs: list[tuple[str, str]], timeout_s: float = 1800, max_tokens: int | None = None) -> dict[str, Any]:
    """Both phases against the server at `url`; the rows per document and the summary. `max_tokens`: the
    answers' budget (None: the server's `generation.max_tokens`)."""
    import functools

    import httpx

    _q = functools.partial(_ask, max_tokens=max_tokens)

    rows = {d: {"document": d} for d, _ in docs}
    with httpx.Client(base_url=url, timeout=timeout_s) as c:
        first_use_s = _ingest(c, docs, "first_use")
        for d, _ in docs:
            rows[d]["chunks"] = c.get(f"/v1/documents/{d}").json()["chunks"]
            rows[d]["cold"] = _q(c, d)
            rows[d]["vanilla"] = _q(c, d, "vanilla")
            rows[d]["after_warm_up"] = _q(c, d)
        for d, _ in docs:
            c.delete(f"/v1/documents/{d}").raise_for_status()
        ingest_s = _ingest(c, docs, "ingest")
        for d, _ in docs:
            rows[d]["warm"] = _q(c, d)
    med = lambda key: statistics.median(r[key]["ttft_ms"] for r in rows.values())  # noqa: E731
    summary = {
        "documents": len(docs), "chunks": sum(r["chunks"] for r in rows.values()),
        "ingest_s": {"first_use": round(first_use_s, 2), "ingest": round(ingest_s, 2),
                     "ratio": round(first_use_s / ingest_s, 3)},
        "ttft_ms_median": {k: round(med(k), 1) for k in ("cold", "vanilla", "after_warm_up", "warm")},
        "cold_over_vanilla": round(statistics.median(r["cold"]["ttft_ms"] / r["vanilla"]["ttft_ms"]
                                                     for r in rows.values()), 3),
        "answers_same_as_eager": sum(r["cold"]["answer"] == r["warm"]["answer"] for r in rows.values()),
        "after_warm_up_computed": sum(r["after_warm_up"]["chunks_computed"] or 0 for r in rows.values()),
    }
    return {"summary": summary, "rows": list(rows.values())}


def render(result: dict[str, Any], command: str) -> str:
    s = result["summary"]
    t = s["ttft_ms_median"]
    lines = [
        "# First use against eager ingestion", "", f"Command: `{command}`", "",
        f"{s['documents']} documents, {s['chunks']} chunks; one query per document naming it.", "",
        "| | first_use | ingest | ratio |", "|---|---|---|---|",
        f"| ingest seconds | {s['ingest_s']['first_use']} | {s['ingest_s']['ingest']} | {s['ingest_s']['ratio']} |", "",
        "| TTFT ms (median over documents) | value |", "|---|---|",
        f"| first query, every chunk cold | {t['cold']} |", f"| vanilla (full prefill) | {t['vanilla']} |",
        f"| the same query after the first | {t['after_warm_up']} |", f"| eagerly ingested (warm) | {t['warm']} |",
        "",
        f"Cold over vanilla (median of per-document ratios): {s['cold_over_vanilla']}x. Chunks computed by "
        f"the queries after the first: {s['after_warm_up_computed']}. Answers over first-use chunks the same "
        f"as over eager ones: {s['answers_same_as_eager']} of {s['documents']}.", "",
        "| document | chunks | cold | vanilla | after | warm | cold kv_compute ms |", "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['document']} | {r['chunks']} | {r['cold']['ttft_ms']} | {r['vanilla']['ttft_ms']} | "
                     f"{r['after_warm_up']['ttft_ms']} | {r['warm']['ttft_ms']} | {r['cold']['kv_compute_ms']} |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    from kvfuse.bench.plots import pyplot

    plt = pyplot()
    s = result["summary"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.bar(["first_use", "ingest"], [s["ingest_s"]["first_use"], s["ingest_s"]["ingest"]], color=["tab:green", "tab:blue"])
    a.set_ylabel("seconds")
    a.set_title(f"ingest, {s['documents']} documents ({s['chunks']} chunks)")
    t = s["ttft_ms_median"]
    names = ["cold (first use)", "vanilla", "after first", "eager (warm)"]
    b.bar(names, [t["cold"], t["vanilla"], t["after_warm_up"], t["warm"]],
          color=["tab:orange", "tab:gray", "tab:green", "tab:blue"])
    b.set_ylabel("TTFT ms (median)")
    b.set_title("one query per document")
    b.tick_params(axis="x", labelrotation=15)
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
        with LocalServer() as server:
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
