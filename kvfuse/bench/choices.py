"""`kvfuse bench choices`: what `n` choices cost on `/v1/chat/completions`, through the real HTTP API.

A request for n choices fuses its context once and forks n decoding rows from that prefill
(fusion/engine/sequence.py), so its time to first token should be that of n = 1, and its decode steps
carry n rows instead of one. This streams the same question over the same documents (given by id, so
every request fuses the same context) with n = 1 and n = each of `--n`, one request at a time and the
values of n interleaved round by round (a drift of the machine's load touches each alike), sampled with
a seed per round. Per n: TTFT (first content delta of any choice) and end-to-end p50 as the client sees
them, the server's own TTFT (`timings.ttft_ms`) and fused prefill (assemble + select + recompute), completion tokens (summed over choices) and their rate,
and each TTFT as a ratio to n = 1's in the same run. docs/results/choices/ holds a run.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from kvfuse.bench.load import LocalServer, ingest_documents, percentile

QUESTION = "What is the main argument of these essays?"


async def stream_chat(client: Any, body: dict[str, Any]) -> dict[str, Any]:
    """POST one streamed chat completion; the client's TTFT and end-to-end time, the server's TTFT, the
    completion tokens and the choices seen."""
    t0 = time.perf_counter()
    ttft = None
    done: dict[str, Any] = {}
    seen: set[int] = set()
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True,
                                                                    "stream_options": {"include_usage": True}}) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{resp.status_code}: {(await resp.aread()).decode()[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                seen.add(c["index"])
                if ttft is None and c.get("delta", {}).get("content"):
                    ttft = time.perf_counter() - t0
            if t := chunk.get("timings"):
                done["server_ttft_s"] = t["ttft_ms"] / 1000.0
                done["prefill_s"] = (t["assemble_ms"] + t["select_ms"] + t["recompute_ms"]) / 1000.0
            if chunk.get("usage"):
                done["completion_tokens"] = chunk["usage"]["completion_tokens"]
    return {"ttft_s": ttft, "e2e_s": time.perf_counter() - t0, "choices": len(seen), **done}


async def measure(url: str, document_ids: list[str], ns: list[int], rounds: int, max_tokens: int,
                  seed: int) -> list[dict[str, Any]]:
    """Every n once per round, in a shuffled order per round; one summary row per n."""
    import httpx

    rng = random.Random(seed)
    samples: dict[int, list[dict[str, Any]]] = {n: [] for n in ns}

    def body(n: int, r: int) -> dict[str, Any]:
        return {"model": "kvfuse", "messages": [{"role": "user", "content": QUESTION}], "document_ids": document_ids,
                "max_tokens": max_tokens, "temperature": 1.0, "seed": seed + r, "n": n}

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await stream_chat(client, body(1, -1))  # warm: the documents' KV in the worker's hot tier
        for r in range(rounds):
            order = list(ns)
            rng.shuffle(order)
            for n in order:
                s = await stream_chat(client, body(n, r))
                if s["choices"] != n:
                    raise RuntimeError(f"n={n} answered with {s['choices']} choices")
                samples[n].append(s)
                print(f"round {r + 1}/{rounds} n={n}: ttft {s['ttft_s']:.3f} s, e2e {s['e2e_s']:.3f} s",
                      file=sys.stderr, flush=True)
    base = percentile([s["ttft_s"] for s in samples[ns[0]]], 50)
    base_prefill = percentile([s["prefill_s"] for s in samples[ns[0]]], 50)
    rows = []
    for n in ns:
        ok = samples[n]
        ttft = percentile([s["ttft_s"] for s in ok], 50)
        prefill = percentile([s["prefill_s"] for s in ok], 50)
        e2e = percentile([s["e2e_s"] for s in ok], 50)
        tokens = sum(s.get("completion_tokens", 0) for s in ok)
        rows.append({"n": n, "requests": len(ok), "ttft_p50_s": round(ttft, 4),
                     "server_ttft_p50_s": round(percentile([s.get("server_ttft_s", 0.0) for s in ok], 50), 4),
                     "e2e_p50_s": round(e2e, 4), "completion_tokens": tokens,
                     "tokens_per_s": round(tokens / sum(s["e2e_s"] for s in ok), 3),
                     "ttft_vs_n1": round(ttft / base, 3) if base else None,
                     "prefill_p50_s": round(prefill, 4),
                     "prefill_vs_n1": round(prefill / base_prefill, 3) if base_prefill else None})
    return rows


def command(args: Any) -> int:
    from kvfuse.bench.data import load_essays, resolve_data_dir
    from kvfuse.bench.machine import command_line, load_info, machine_info
    from kvfuse.bench.report import markdown_table

    ns = list(dict.fromkeys([1, *args.n]))
    essays = list(load_essays(resolve_data_dir(args.data_dir)))
    random.Random(args.seed).shuffle(essays)
    load_at_start = load_info()
    with LocalServer({"KVFUSE_SERVER__MAX_CHOICES": str(max(ns))}) as server:
        doc_ids, context, _ = ingest_documents(server.url, None, essays, args.context_tokens, args.docs)
        rows = asyncio.run(measure(server.url, doc_ids, ns, args.rounds, args.max_tokens, args.seed))
    payload = {"kind": "choices", "command": command_line("kvfuse bench choices", args.parser, args),
               "created": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
               "machine": {**machine_info(), **{f"{k}_at_start": v for k, v in load_at_start.items()}, **load_info()},
               "params": {"context_tokens": context, "docs": args.docs, "max_tokens": args.max_tokens,
                          "rounds": args.rounds, "seed": args.seed}, "rows": rows}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    columns = [("n", "n"), ("ttft_p50_s", "TTFT p50 (s)"), ("server_ttft_p50_s", "server TTFT p50 (s)"),
               ("ttft_vs_n1", "TTFT / n=1"), ("prefill_p50_s", "fused prefill p50 (s)"),
               ("prefill_vs_n1", "prefill / n=1"), ("e2e_p50_s", "e2e p50 (s)"), ("completion_tokens", "tokens"),
               ("tokens_per_s", "tokens/s")]
    print(markdown_table(rows, columns))
    print(f"\nwrote {path}", file=sys.stderr)
    return 0


def register(bsub: Any) -> None:
    """Add `kvfuse bench choices` (imports nothing heavy)."""
    from kvfuse.bench.args import csv_list
    from kvfuse.bench.data import DATA_DIR_HELP
    from kvfuse.bench.report import SCRATCH_DIR

    p = bsub.add_parser("choices", help="n choices from one fused prefill: TTFT and tokens/s against n = 1")
    p.add_argument("--n", type=csv_list(int), default=[4], help="the values of n measured beside n = 1")
    p.add_argument("--rounds", type=int, default=5, help="requests per value of n (interleaved)")
    p.add_argument("--context-tokens", type=int, default=2048, help="tokens of the documents every request uses")
    p.add_argument("--docs", type=int, default=4, help="documents (essay openings) that make up the context")
    p.add_argument("--max-tokens", type=int, default=16, help="answer length limit per choice")
    p.add_argument("--seed", type=int, default=0, help="document choice, the order of n per round, sampling seeds")
    p.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
    p.add_argument("--json", default=str(SCRATCH_DIR / "choices.json"), help="result file")
    p.set_defaults(func=command, parser=p)
