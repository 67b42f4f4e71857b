"""`kvfuse bench overload`: a server flooded past every bound while queries run, through its real HTTP API.

What it checks is docs/DESIGN.md, "Bounded under load": flood clients under two API keys, without pause
and never waiting for an answer's job: under one, ingestion batches, small file uploads and bodies past
`server.max_body_bytes` (past its share of the ingestion queue); under the other, uploads of a DOCX that
expands to far more text than a document may hold, from more clients than there are parse processes and
waiters' places (past `server.upload_parse_waiters`); a third key sends one document now and then (it
must not be locked out); one client queries. Blocks with and without the flood
alternate on one server (so the machine's other load falls on both alike), and a burst of requests at
once passes `server.max_concurrent_requests`. Reported: the API process's peak RSS (sampled from /proc)
against the bound its settings set (`rss_bound_mb`), the queries' p95 latency with and without the flood,
every answer's status and code (429s, and that no 5xx came), and that every accepted ingestion ended
`ready`. It starts a server with small limits (`SERVER_ENV`) unless `--url` names one.
"""

from __future__ import annotations

import io
import json
import math
import threading
import time
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

# The keys and the flood live in overload_flood.py; named here too, for the suite's flood test.
from kvfuse.bench.overload_flood import (  # noqa: F401
    FAIR_KEY,
    FLOOD_KEYS,
    QUERY_KEY,
    Flood,
    OverloadConfig,
    Tally,
    _json,
    wait_jobs,
)

MB = 1024 * 1024
QUESTION = "What did the palliative care nurse Bronnie Ware make a list of?"  # in essay "todo"
# The server the command starts: limits small enough that a short flood passes each of them.
SERVER_ENV = {
    "KVFUSE_SERVER__API_KEYS": ",".join([QUERY_KEY, *FLOOD_KEYS, FAIR_KEY]),
    "KVFUSE_SERVER__INGEST_QUEUE_SIZE": "8",
    "KVFUSE_SERVER__INGEST_QUEUE_KEY_SHARE": "0.34",
    "KVFUSE_SERVER__MAX_CONCURRENT_REQUESTS": "16",
    "KVFUSE_SERVER__MAX_BODY_BYTES": str(MB),
    "KVFUSE_SERVER__MAX_DOCUMENT_CHARS": "200000",
    "KVFUSE_SERVER__UPLOAD_PARSE_WORKERS": "1",
    "KVFUSE_SERVER__UPLOAD_PARSE_WAITERS": "2",
    "KVFUSE_SERVER__UPLOAD_PARSE_TIMEOUT_S": "10",
    "KVFUSE_RETRIEVER__CHUNK_TOKENS": "64",
    "KVFUSE_STORE__PRECOMPUTE_CONTEXT": "none",
    "KVFUSE_RETRIEVER__TOP_K": "2",
    "KVFUSE_MODEL__MAX_CONTEXT_TOKENS": "1024",
    "KVFUSE_GENERATION__MAX_TOKENS": "4",
}


def amplifying_docx(chars: int = 21_000_000, char: str = "\u4e2d", paragraph: int = 100_000) -> bytes:
    """A DOCX of paragraphs of `paragraph` copies of one CJK character, `chars` in all: about 100 kB on the
    wire, 3 bytes a character inflated (21 M characters stay within a 100 MB decompressed limit), 6 as
    escaped JSON. (Paragraphs, not one: libxml2 refuses a text node past 10 MB.)"""
    import docx

    template = io.BytesIO()
    docx.Document().save(template)
    source, out = zipfile.ZipFile(template), io.BytesIO()
    head = (b'<?xml version="1.0" encoding="UTF-8"?><w:document xmlns:w="http://schemas.openxmlformats.org/'
            b'wordprocessingml/2006/main"><w:body>')
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for item in source.infolist():
            if item.filename != "word/document.xml":
                z.writestr(item, source.read(item.filename))
                continue
            with z.open(item.filename, "w") as member:
                member.write(head)
                for left in range(chars, 0, -paragraph):
                    member.write(b"<w:p><w:r><w:t>" + (char * min(left, paragraph)).encode() + b"</w:t></w:r></w:p>")
                member.write(b"</w:body></w:document>")
    return out.getvalue()


def rss_mb(pid: int) -> float:
    """The resident set of process `pid` now (VmRSS), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class RssSampler:
    """The peak RSS of a process, sampled every `every_s` on a thread while in the `with` block."""

    def __init__(self, pid: int, every_s: float = 0.05) -> None:
        self.pid, self.every_s = pid, every_s
        self.peak_mb = self.start_mb = rss_mb(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak_mb = max(self.peak_mb, rss_mb(self.pid))

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.peak_mb = max(self.peak_mb, rss_mb(self.pid))


def rss_bound_mb(server: dict[str, Any], baseline_mb: float) -> float:
    """What the settings let the API process hold beyond `baseline_mb` (DESIGN, "Bounded under load"):
    each request answered at once its body three times over (the bytes, the parsed JSON or form, the
    validated document), each waiting job a 4 kB record, and the one running document 16 bytes a
    character (its text, chunks, token ids and vectors)."""
    per_request = 3 * server["max_body_bytes"]
    return round(baseline_mb + (server["max_concurrent_requests"] * per_request + server["ingest_queue_size"] * 4096
                                + 16 * server["max_document_chars"]) / MB, 1)


def query(c: Any, tally: Counter, timings: list[dict[str, float]] | None = None) -> float:
    """One query's latency, as its client sees it: a 429 is retried after its Retry-After (and counted);
    the answer's own `timings` (where the server spent it, ms) go to `timings`."""
    started = time.perf_counter()
    while True:
        resp = c.post("/v1/query", json={"query": QUESTION, "max_tokens": 4})
        tally[resp.status_code] += 1
        if resp.status_code != 429:
            break
        time.sleep(float(resp.headers.get("Retry-After", "1")))
    if resp.status_code != 200:
        raise RuntimeError(f"a query answered {resp.status_code}: {resp.text[:300]}")
    if timings is not None:
        timings.append(resp.json().get("timings") or {})
    return time.perf_counter() - started


def burst(url: str, requests: int) -> Counter:
    """`requests` listings sent at once (past `server.max_concurrent_requests`): status -> answers."""
    import httpx

    seen: Counter = Counter()
    lock, go = threading.Lock(), threading.Event()

    def one() -> None:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {QUERY_KEY}"}, timeout=120) as c:
            go.wait()
            resp = c.post("/v1/search", json={"query": QUESTION})
            with lock:
                seen[(resp.status_code, (_json(resp).get("error") or {}).get("code", ""))] += 1

    threads = [threading.Thread(target=one) for _ in range(requests)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(300)
    return seen


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[math.ceil(0.95 * len(ordered)) - 1]


def ratio_interval(quiet: list[float], flood: list[float], draws: int = 2000, seed: int = 0) -> list[float]:
    """A 95% bootstrap interval of p95(flood) / p95(quiet): each kind's queries resampled with
    replacement (seeded), the 2.5th and 97.5th percentiles of the ratio over `draws` resamples. Wide
    with a few dozen queries a kind: the spread the single ratio does not show."""
    import random

    rng = random.Random(seed)
    ratios = sorted(p95(rng.choices(flood, k=len(flood))) / p95(rng.choices(quiet, k=len(quiet)))
                    for _ in range(draws))
    return [round(ratios[int(0.025 * draws)], 3), round(ratios[min(draws - 1, int(0.975 * draws))], 3)]


def _blocks(cfg: OverloadConfig, c: Any, tally: Tally, queries: Counter, amplifier: bytes) -> list[Any]:
    """The alternating blocks, each measured (overload_meter.py)."""
    from kvfuse.bench.overload_meter import BlockMeter

    blocks = []
    for r in range(cfg.rounds):
        for phase in (("quiet", "flood") if r % 2 == 0 else ("flood", "quiet")):
            with BlockMeter(c, cfg.api_pid, phase) as block:
                if phase == "quiet":
                    block.queries_s = [query(c, queries, block.timings) for _ in range(cfg.per_block)]
                else:
                    sent, cpu = sum(tally.answers.values()), tally.client_cpu_s
                    with Flood(cfg.url, tally, clients=cfg.clients, uploaders=cfg.uploaders, batch=cfg.batch,
                               amplifier=amplifier, body_limit=cfg.server["max_body_bytes"]):
                        time.sleep(0.5)  # the flood is flowing before the block's first query
                        block.queries_s = [query(c, queries, block.timings) for _ in range(cfg.per_block)]
                    block.flood_requests = sum(tally.answers.values()) - sent
                    block.cpu_s["flood_clients"] = tally.client_cpu_s - cpu
            blocks.append(block)
    return blocks


def _pairs(blocks: list[Any]) -> list[tuple[Any, Any]]:
    """(quiet, flood) block of each round, in the order run."""
    quiet, flood = [b for b in blocks if b.phase == "quiet"], [b for b in blocks if b.phase == "flood"]
    return list(zip(quiet, flood, strict=True))


def run_overload(cfg: OverloadConfig) -> dict[str, Any]:
    """The blocks, the refusal costs, the burst and the wait for every accepted job; the figures (DESIGN's
    targets beside) and where the time went (overload_meter.py, overload_costs.py)."""
    import dataclasses

    import httpx

    from kvfuse.bench.overload_costs import refusal_costs
    from kvfuse.bench.overload_meter import summarize_blocks

    tally, queries = Tally(), Counter()
    amplifier = amplifying_docx()
    with httpx.Client(base_url=cfg.url, headers={"Authorization": f"Bearer {QUERY_KEY}"}, timeout=300) as c:
        for _ in range(3):
            query(c, Counter())  # warm: the first queries pay for lazy setup
        baseline = rss_mb(cfg.api_pid)
        with RssSampler(cfg.api_pid) as rss:
            blocks = _blocks(cfg, c, tally, queries, amplifier)
            costs = refusal_costs(cfg, amplifier, tally) if cfg.cost_window_s > 0 else {}
            bursts = burst(cfg.url, cfg.burst)
    jobs = wait_jobs(cfg.url, tally.jobs, cfg.jobs_timeout_s)
    timed = {p: [s for b in blocks if b.phase == p for s in b.queries_s] for p in ("quiet", "flood")}
    quiet, flood = p95(timed["quiet"]), p95(timed["flood"])
    return {
        "rss_baseline_mb": round(baseline, 1), "rss_peak_mb": round(rss.peak_mb, 1),
        "rss_bound_mb": rss_bound_mb(cfg.server, baseline),
        "p95_quiet_s": round(quiet, 4), "p95_flood_s": round(flood, 4), "p95_ratio": round(flood / quiet, 3),
        "p95_ratio_interval_95": ratio_interval(timed["quiet"], timed["flood"]),
        # each round's own ratio (its flood block's p95 over its quiet block's): how far one block pair moves
        "p95_ratio_by_round": [round(p95(f.queries_s) / p95(q.queries_s), 3) for q, f in _pairs(blocks)],
        "p50_quiet_s": round(sorted(timed["quiet"])[len(timed["quiet"]) // 2], 4),
        "p50_flood_s": round(sorted(timed["flood"])[len(timed["flood"]) // 2], 4),
        "queries_each": len(timed["quiet"]), "query_statuses": dict(sorted(queries.items())),
        "flood_requests": sum(tally.answers.values()), "flood_429": tally.count(429),
        "flood_5xx": tally.count(low=500, high=600),
        "flood_answers": {f"{k} {s} {code}".strip(): n for (k, s, code), n in sorted(tally.answers.items())},
        "fair_accepted": sum(n for (k, s, _), n in tally.answers.items() if k == "fair" and s == 202),
        "fair_sent": sum(n for (k, _, _), n in tally.answers.items() if k == "fair"),
        "burst_answers": {f"{s} {code}".strip(): n for (s, code), n in sorted(bursts.items())},
        "jobs_accepted": len(tally.jobs), "jobs_final": dict(sorted((str(k), v) for k, v in jobs.items())),
        "where_time_went": summarize_blocks(blocks), "refusal_costs": costs,
        "blocks": [dataclasses.asdict(b) for b in blocks],
    }


def targets_met(result: dict[str, Any], max_p95_ratio: float = 1.5) -> dict[str, bool]:
    """DESIGN's targets, each checked."""
    bursts = result["burst_answers"]
    return {"rss_within_bound": result["rss_peak_mb"] <= result["rss_bound_mb"],
            "p95_within_ratio": result["p95_ratio"] <= max_p95_ratio,
            "no_5xx": result["flood_5xx"] == 0 and not any(k.startswith("5") for k in bursts),
            "some_429": result["flood_429"] > 0 and "429 server_busy" in bursts,
            "fair_key_served": result["fair_accepted"] > 0,
            "every_accepted_job_ready": result["jobs_final"] == {"ready": result["jobs_accepted"]}}


def server_settings(env: dict[str, str]) -> dict[str, Any]:
    """The server settings a server started with `env` (KVFUSE_SERVER__* over this process's) runs with."""
    from kvfuse.config import ServerSettings, get_settings

    prefix = "KVFUSE_SERVER__"
    given = {k[len(prefix):].lower(): v for k, v in env.items() if k.startswith(prefix)}
    return ServerSettings(**{**get_settings().server.model_dump(), **given}).model_dump()


# -- the command ---------------------------------------------------------------------------------------------
def command(args: Any) -> int:
    from kvfuse.bench.data import load_essays, resolve_data_dir
    from kvfuse.bench.load import LocalServer
    from kvfuse.bench.machine import command_line, load_info, machine_info

    essays = dict(load_essays(resolve_data_dir(args.data_dir)))
    with LocalServer(SERVER_ENV) as server:
        import httpx

        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {QUERY_KEY}"}, timeout=600) as c:
            for name in ("todo", "nft"):
                c.post("/v1/documents?wait=true", json={"id": name, "text": essays[name]}).raise_for_status()
        cfg = OverloadConfig(url=server.url, api_pid=server.proc.pid, server=server_settings(SERVER_ENV),
                             rounds=args.rounds,
                             per_block=args.per_block, clients=args.clients, uploaders=args.uploaders, batch=args.batch,
                             burst=args.burst, cost_window_s=args.cost_window_s)
        result = run_overload(cfg)
    ended = load_info()
    checks = targets_met(result)
    payload = {"kind": "overload", "command": command_line("kvfuse bench overload", args.parser, args),
               "machine": {**machine_info(), **load_info(), "load_avg_1m_at_end": ended.get("load_avg_1m")}, "server_env": SERVER_ENV, "result": result,
               "targets": checks}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    from kvfuse.bench.overload_meter import plot
    from kvfuse.bench.plots import plot_if_possible

    png = plot_if_possible(plot, payload, path.with_suffix(".png"))
    print(json.dumps({"result": {k: v for k, v in result.items() if k != "blocks"}, "targets": checks}, indent=1))
    print(f"\nwrote {path}" + (f" and {png}" if png else ""))
    return 0 if all(checks.values()) else 1


def register(bsub: Any) -> None:
    """Add `kvfuse bench overload` (imports nothing heavy)."""
    from kvfuse.bench.data import DATA_DIR_HELP
    from kvfuse.bench.report import SCRATCH_DIR

    p = bsub.add_parser("overload", help="a server flooded past every bound while queries run: RSS, p95, 429s")
    p.add_argument("--rounds", type=int, default=2, help="alternating blocks of each kind (with and without the flood)")
    p.add_argument("--per-block", type=int, default=6, help="queries per block")
    p.add_argument("--clients", type=int, default=1, help="flood threads of the ingesting flood key")
    p.add_argument("--uploaders", type=int, default=4, help="flood threads of the uploading flood key")
    p.add_argument("--batch", type=int, default=2, help="documents per flood batch")
    p.add_argument("--burst", type=int, default=48, help="requests sent at once after the blocks")
    p.add_argument("--cost-window-s", type=float, default=5.0,
                   help="seconds of each window measuring a refusal's cost by kind (0: not measured)")
    p.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
    p.add_argument("--json", default=str(SCRATCH_DIR / "overload.json"), help="result file")
    p.set_defaults(func=command, parser=p)
