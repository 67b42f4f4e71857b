"""`kvfuse bench load`: how the service holds up with many users, measured through its real HTTP API.

A single-request benchmark cannot show what batching buys: with one stream a server that runs one
request at a time and one that batches look the same. So this sends streamed queries at once -- a
closed-loop sweep over concurrency levels (each of N users sends its next query when its answer ends)
and optionally an open-loop run at a fixed arrival rate (Poisson, seeded), where queueing shows as
time to first token -- for each fusion method (the default and `vanilla`) over the same documents,
given explicitly so every request fuses the same contexts. Per level: TTFT and inter-token latency
p50/p95 as the client sees them, generated tokens/s and requests/s over the level's wall time.

It starts a server (`kvfuse serve` on a free loopback port with a fresh data dir) unless `--url` names
one; the plot (the optional extra `kvfuse[bench]`, see plots.py) puts throughput and TTFT against concurrency.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

QUESTIONS = ("What is the main argument of these essays?", "What advice does the author give?",
             "Which examples does the author use?", "What does the author say about startups?")


@dataclass
class Sample:
    """One streamed query as its client saw it."""

    ok: bool
    status: int = 200
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)  # between token events (an event may hold several tokens)
    completion_tokens: int = 0
    worker: str | None = None  # the fleet worker that answered (the answer names it)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between ranks; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(samples: list[Sample], wall_s: float) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    ttft = [s.ttft_s for s in ok]
    gaps = [g for s in ok for g in s.gaps_s]
    tokens = sum(s.completion_tokens for s in ok)
    r = lambda v: None if v is None else round(v, 4)  # noqa: E731
    failed = sorted({s.status for s in samples if not s.ok})
    return {"requests": len(samples), "errors": len(samples) - len(ok), "error_statuses": failed,
            "wall_s": round(wall_s, 3),
            "ttft_p50_s": r(percentile(ttft, 50)), "ttft_p95_s": r(percentile(ttft, 95)),
            "itl_p50_s": r(percentile(gaps, 50)), "itl_p95_s": r(percentile(gaps, 95)),
            "e2e_p50_s": r(percentile([s.e2e_s for s in ok], 50)), "generated_tokens": tokens,
            # vLLM's TPOT: a request's decode time over its tokens after the first (events may hold several)
            "tpot_p50_s": r(percentile([(s.e2e_s - s.ttft_s) / (s.completion_tokens - 1)
                                        for s in ok if s.completion_tokens > 1], 50)),
            "tokens_per_s": round(tokens / wall_s, 3) if wall_s > 0 else None,
            "requests_per_s": round(len(ok) / wall_s, 4) if wall_s > 0 else None,
            # how a fleet spread the answers over its workers (none named: one embedded worker)
            "served_by": dict(sorted(Counter(s.worker for s in ok if s.worker).items())) or None}


async def stream_query(client: Any, body: dict[str, Any]) -> Sample:
    """POST a streamed /v1/query and time its token events."""
    t0 = time.perf_counter()
    sample = Sample(ok=False)
    last = None
    event = None
    async with client.stream("POST", "/v1/query", json={**body, "stream": True}) as resp:
        sample.status = resp.status_code
        if resp.status_code != 200:
            await resp.aread()
            return sample
        async for line in resp.aiter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                now = time.perf_counter()
                if event == "token":
                    if last is None:
                        sample.ttft_s = now - t0
                    else:
                        sample.gaps_s.append(now - last)
                    last = now
                elif event == "done":
                    done = json.loads(line[6:])
                    sample.completion_tokens = int(done.get("usage", {}).get("completion_tokens", 0))
                    sample.worker = done.get("worker")
                    sample.ok = True
                elif event == "error":
                    sample.ok = False
                event = None
    sample.e2e_s = time.perf_counter() - t0
    return sample


def _body(cfg: LoadConfig, method: str, i: int) -> dict[str, Any]:
    return {"query": QUESTIONS[i % len(QUESTIONS)], "document_ids": cfg.document_ids, "max_tokens": cfg.max_tokens,
            "temperature": 0.0, "fusion": {"method": method}}


@dataclass
class LoadConfig:
    url: str
    api_key: str | None
    document_ids: list[str]
    methods: list[str]
    concurrency: list[int]
    rounds: int = 2  # queries per user per level (closed loop)
    max_tokens: int = 32
    rate: float | None = None  # open loop: arrivals per second
    open_requests: int = 16
    seed: int = 0
    timeout_s: float = 600.0


def _client(cfg: LoadConfig) -> Any:
    import httpx

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    return httpx.AsyncClient(base_url=cfg.url, headers=headers, timeout=cfg.timeout_s,
                             limits=httpx.Limits(max_connections=256, max_keepalive_connections=256))


async def closed_loop(cfg: LoadConfig, method: str, users: int) -> dict[str, Any]:
    async with _client(cfg) as client:
        await stream_query(client, _body(cfg, method, 0))  # warm: the documents' KV in the worker's hot tier

        async def user(u: int) -> list[Sample]:
            return [await stream_query(client, _body(cfg, method, u * cfg.rounds + k)) for k in range(cfg.rounds)]

        t0 = time.perf_counter()
        per_user = await asyncio.gather(*(user(u) for u in range(users)))
        wall = time.perf_counter() - t0
    return {"method": method, "mode": "closed", "concurrency": users,
            **summarize([s for group in per_user for s in group], wall)}


async def open_loop(cfg: LoadConfig, method: str) -> dict[str, Any]:
    assert cfg.rate
    rng = random.Random(cfg.seed)
    async with _client(cfg) as client:
        t0 = time.perf_counter()
        tasks = []
        for i in range(cfg.open_requests):
            tasks.append(asyncio.create_task(stream_query(client, _body(cfg, method, i))))
            await asyncio.sleep(rng.expovariate(cfg.rate))
        samples = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    return {"method": method, "mode": "open", "rate": cfg.rate, "concurrency": None, **summarize(samples, wall)}


def run_load(cfg: LoadConfig, on_row: Any = None) -> list[dict[str, Any]]:
    """Every method × level (then the open-loop run per method); `on_row(rows)` after each."""
    rows: list[dict[str, Any]] = []
    for method in cfg.methods:
        for users in cfg.concurrency:
            rows.append(asyncio.run(closed_loop(cfg, method, users)))
            if on_row is not None:
                on_row(rows)
        if cfg.rate:
            rows.append(asyncio.run(open_loop(cfg, method)))
            if on_row is not None:
                on_row(rows)
    return rows


# -- a server to measure ------------------------------------------------------------------------------------
class LocalServer:
    """`kvfuse serve` in a subprocess on a free loopback port, with its own data dir (removed after)."""

    def __init__(self, env: dict[str, str] | None = None, start_timeout_s: float = 600.0) -> None:
        self.env = env or {}
        self.start_timeout_s = start_timeout_s
        self.tmp = tempfile.TemporaryDirectory(prefix="kvfuse-load-")
        self.proc: subprocess.Popen | None = None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LocalServer:
        from kvfuse.service.probe import wait_ready

        env = {**os.environ, "KVFUSE_DATA_DIR": str(Path(self.tmp.name) / "data"), "KVFUSE_SERVER__HOST": "127.0.0.1",
               "KVFUSE_SERVER__PORT": str(self.port), "KVFUSE_SERVER__API_KEYS": "", **self.env}
        log = open(Path(self.tmp.name) / "server.log", "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen([sys.executable, "-m", "kvfuse.cli", "serve"], env=env, stdout=log,
                                     stderr=subprocess.STDOUT)
        log.close()
        if wait_ready(self.url, self.start_timeout_s, alive=lambda: self.proc.poll() is None):
            return self
        if self.proc.poll() is not None:
            raise RuntimeError(f"the server exited with {self.proc.returncode}: see {self.tmp.name}/server.log")
        self.__exit__()
        raise TimeoutError(f"the server was not ready after {self.start_timeout_s} s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.tmp.cleanup()


def ingest_documents(url: str, api_key: str | None, texts: list[tuple[str, str]], context_tokens: int,
                     docs: int = 4) -> tuple[list[str], int, float | None]:
    """Ingest `docs` essay openings of about context_tokens / docs tokens each (cut on a word boundary),
    one after another, each waited for; returns their ids, their tokens in all and the seconds the
    ingestion requests took (chunk, embed, precompute and store: what `store.precompute_context` costs).
    A document the server already holds ready with the same text is not sent again (a second run against
    a live server leaves its chunk caches where they are); the seconds are then None, not measured."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    chars = max(200, int(context_tokens / docs * 3.5))  # English prose: ~3.5-4 characters per token
    ids, total, seconds, reused = [], 0, 0.0, False
    with httpx.Client(base_url=url, headers=headers, timeout=600) as c:
        for name, text in texts[:docs]:
            cut = text[:chars]
            cut = cut[: cut.rfind(" ")] if " " in cut and len(text) > chars else cut
            doc_id = f"load-{name}"
            have = c.get(f"/v1/documents/{doc_id}", params={"include_text": "true"})
            if have.status_code == 200 and have.json()["status"] == "ready" and have.json().get("text") == cut:
                ids.append(doc_id)
                total += have.json()["tokens"]
                reused = True
                continue
            t0 = time.perf_counter()
            resp = c.post("/v1/documents?wait=true", json={"id": doc_id, "text": cut, "on_conflict": "overwrite"})
            resp.raise_for_status()
            seconds += time.perf_counter() - t0
            ids.append(doc_id)
            total += c.get(f"/v1/documents/{doc_id}").json()["tokens"]
    return ids, total, None if reused else seconds


def config_dict(cfg: LoadConfig) -> dict[str, Any]:
    out = asdict(cfg)
    out.pop("api_key", None)
    return out


# -- the command ---------------------------------------------------------------------------------------------
class LoadRun:
    """One result file: every measured row (tagged with the server's shadow rate when the run sweeps
    them), each server's `GET /v1/fidelity` at its end, saved after every row."""

    def __init__(self, args: Any, json_path: Path, methods: list[str]) -> None:
        from kvfuse.bench.machine import command_line, machine_info

        self.args, self.json_path, self.methods = args, json_path, methods
        self.command = command_line("kvfuse bench load", args.parser, args)
        self.machine = machine_info()
        self.created = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        self.rows: list[dict[str, Any]] = []
        self.params: dict[str, Any] = {}
        self.fidelity: dict[str, Any] = {}

    def measure(self, url: str, api_key: str | None, essays: list[tuple[str, str]], tag: dict[str, Any]) -> None:
        """Ingest the documents into the server at `url`, then run every method and level against it."""
        a = self.args
        doc_ids, context, ingest_s = ingest_documents(url, api_key, essays, a.context_tokens, a.docs)
        cfg = LoadConfig(url=url, api_key=api_key, document_ids=doc_ids, methods=self.methods,
                         concurrency=a.concurrency, rounds=a.rounds, max_tokens=a.max_tokens, rate=a.rate,
                         open_requests=a.open_requests, seed=a.seed)
        # A sweep starts one server per shadow rate and ingests into each: keep every server's time, and
        # the first as the one the report quotes.
        each = [*self.params.get("ingest_s_each", []), ingest_s and round(ingest_s, 3)]
        self.params = {**config_dict(cfg), "context_tokens": context, "ingest_s": each[0],
                       **({"shadow_rates": a.shadow_rates, "ingest_s_each": each} if a.shadow_rates else {})}
        done = len(self.rows)

        def on_row(rows: list[dict[str, Any]]) -> None:
            self.rows[done:] = [{**tag, **r} for r in rows]
            self.save()

        run_load(cfg, on_row)

    def save(self, partial: bool = True) -> None:
        from kvfuse.bench.machine import load_info

        self.json_path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"kind": "load", "command": self.command, "created": self.created,
                   "machine": {**self.machine, **load_info()}, "params": self.params, "partial": partial,
                   "rows": self.rows, **({"fidelity": self.fidelity} if self.fidelity else {})}
        self.json_path.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")


def fidelity_snapshot(url: str) -> dict[str, Any]:
    """The server's `GET /v1/fidelity` (how many checks had run by the end of its load)."""
    import httpx

    return httpx.get(f"{url}/v1/fidelity", timeout=30).json()


def command(args: Any) -> int:
    from kvfuse.bench import load_report, report
    from kvfuse.bench.data import load_essays, resolve_data_dir

    if args.url and args.shadow_rates:
        print("kvfuse bench load: --shadow-rates starts its own servers; it cannot measure --url", file=sys.stderr)
        return 2
    json_path = Path(args.json)
    run = LoadRun(args, json_path, list(dict.fromkeys([*args.methods, "vanilla"])))
    essays = list(load_essays(resolve_data_dir(args.data_dir)))
    random.Random(args.seed).shuffle(essays)
    if args.url:
        run.measure(args.url, args.api_key, essays, {})
    else:
        # One server per shadow rate, one after another (a server left running would go on checking in
        # the next one's time): the same load against each, so p95 TTFT compares within one run.
        for rate in args.shadow_rates or [None]:
            env = {} if rate is None else {"KVFUSE_FIDELITY__SHADOW_RATE": str(rate)}
            with LocalServer(env) as server:
                run.measure(server.url, None, essays, {} if rate is None else {"shadow_rate": rate})
                if rate is not None:
                    run.fidelity[str(rate)] = fidelity_snapshot(server.url)
    run.save(partial=False)
    md, png = report.render(json.loads(json_path.read_text(encoding="utf-8")), json_path)
    print(report.markdown_table(run.rows, load_report.table(run.rows)))
    if args.shadow_rates:
        print("\n" + report.markdown_table(load_report.shadow_cost(run.rows, run.fidelity), load_report.SHADOW_TABLE))
    print(f"\nwrote {json_path}, {md}, {png}", file=sys.stderr)
    return 0


def register(bsub: Any) -> None:
    """Add `kvfuse bench load` (imports nothing heavy)."""

    from kvfuse.bench.args import csv_list
    from kvfuse.bench.data import DATA_DIR_HELP
    from kvfuse.bench.report import SCRATCH_DIR

    p = bsub.add_parser("load", help="many concurrent streamed queries through a real server: TTFT, ITL, tokens/s")
    p.add_argument("--concurrency", type=csv_list(int), default=[1, 2, 4, 8, 16], help="concurrent streams per level")
    p.add_argument("--rounds", type=int, default=2, help="queries each stream sends per level")
    p.add_argument("--rate", type=float, default=None, help="also an open-loop run at this many requests/s")
    p.add_argument("--open-requests", type=int, default=32, help="requests of the open-loop run")
    p.add_argument("--methods", type=lambda t: [m for m in t.split(",") if m], default=["anchor"],
                   help="fusion methods (vanilla always runs too)")
    p.add_argument("--context-tokens", type=int, default=4096, help="tokens of the documents every query uses")
    p.add_argument("--docs", type=int, default=4, help="documents (essay openings) that make up the context")
    p.add_argument("--max-tokens", type=int, default=32, help="answer length limit")
    p.add_argument("--seed", type=int, default=0, help="document choice and open-loop arrivals")
    p.add_argument("--shadow-rates", type=csv_list(float), default=None,
                   help="what shadow checks cost: the same load against a server per fidelity.shadow_rate "
                        "(e.g. 0,0.1,1), started in turn, p95 TTFT compared with the first")
    p.add_argument("--url", default=None, help="measure this server instead of starting one")
    p.add_argument("--api-key", default=None, help="API key for --url")
    p.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
    p.add_argument("--json", default=str(SCRATCH_DIR / "load.json"), help="result file; the .png plot goes beside it")
    p.set_defaults(func=command, parser=p)
