"""Where a query's time goes under `kvfuse bench overload`'s flood: what each block of the bench cost each
process, read from outside the server.

Per block (docs/results/overload/README.md): the CPU seconds of the API process, of its worker and of
its parse processes (/proc), and of the flood's own client threads (they share the server's machine,
which a real flood's clients would not); the worker's engine steps (`kvfuse_engine_step_seconds`, by
whether ingestion's precompute had a share of the step) and the API's event-loop lag
(`kvfuse_event_loop_lag_seconds`), both from the server's /metrics; the machine's load average; and the
parts of each query's time as its answer reports them (`timings`). Read only by the bench: nothing here is
part of the service.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK")
_SAMPLE = re.compile(r'^(kvfuse_engine_step_seconds|kvfuse_event_loop_lag_seconds)_(sum|count|bucket)'
                     r'(?:\{([^}]*)\})? ([0-9.e+-]+)$')
# The parts of a query's answer (`timings`, milliseconds) the report shows, in the order they happen.
TIMING_PARTS = ("retrieval_ms", "queue_ms", "kv_load_ms", "ttft_ms", "decode_ms", "total_ms")


def cpu_s(pid: int) -> float:
    """The user + system CPU seconds process `pid` has used (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def role(pid: int) -> str:
    """What a child of the API process is: a parse process, the worker (multiprocessing's spawn), or other."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "other"
    if "parse_worker" in cmd:
        return "parse"
    return "worker" if "spawn_main" in cmd else "other"


def server_cpu(api_pid: int) -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds) of the API process and its children. A parse process that exits between
    two readings takes its CPU with it: the parse figures are a floor."""
    return {api_pid: ("api", cpu_s(api_pid)), **{p: (role(p), cpu_s(p)) for p in children(api_pid)}}


def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds by role between two readings (a process new since `before` counts from zero)."""
    out: dict[str, float] = {"api": 0.0, "worker": 0.0, "parse": 0.0}
    for pid, (kind, used) in after.items():
        if kind in out:
            out[kind] += used - before.get(pid, (kind, 0.0))[1]
    return out


def read_metrics(c: Any) -> dict[str, float]:
    """The step and loop-lag histograms of the server's /metrics, flat: `name|labels|part` -> value."""
    out: dict[str, float] = {}
    for line in c.get("/metrics").text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[f"{m[1]}|{m[3] or ''}|{m[2]}"] = float(m[4])
    return out


def histogram_delta(before: dict[str, float], after: dict[str, float], name: str,
                    labels: str = "") -> dict[str, Any]:
    """Observations, mean and an upper bound of the 99th percentile (the first bucket holding it) of one
    histogram between two /metrics readings."""
    def get(key: str, src: dict[str, float]) -> float:
        return src.get(key, 0.0)

    n = get(f"{name}|{labels}|count", after) - get(f"{name}|{labels}|count", before)
    total = get(f"{name}|{labels}|sum", after) - get(f"{name}|{labels}|sum", before)
    buckets = sorted(
        (float("inf") if (le := k.split('le="')[1].split('"')[0]) == "+Inf" else float(le),
         v - before.get(k, 0.0))
        for k, v in after.items()
        if k.startswith(f"{name}|") and k.endswith("|bucket") and (not labels or labels in k))
    p99 = next((le for le, count in buckets if n and count >= 0.99 * n), None)
    return {"n": int(n), "mean_s": round(total / n, 5) if n else None, "sum_s": round(total, 3),
            "p99_le_s": p99 if p99 != float("inf") else "inf"}


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


@dataclass
class Block:
    """One block of the bench (quiet or flood) as its meter saw it."""

    phase: str
    wall_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)  # api, worker, parse, flood_clients
    steps: dict[str, Any] = field(default_factory=dict)  # query / ingest: n, mean_s, sum_s, p99_le_s
    loop_lag: dict[str, Any] = field(default_factory=dict)
    flood_requests: int = 0
    load: tuple[float, float] = (0.0, 0.0)  # the 1-minute load average at the block's start and end
    queries_s: list[float] = field(default_factory=list)
    timings: list[dict[str, float]] = field(default_factory=list)  # each query's answer's timings (ms)


class BlockMeter:
    """Measures one block: `with BlockMeter(c, api_pid, phase) as block: ...` (the client `c` reads
    /metrics with a key that may)."""

    def __init__(self, c: Any, api_pid: int, phase: str) -> None:
        self.c, self.api_pid, self.block = c, api_pid, Block(phase)

    def __enter__(self) -> Block:
        self._metrics, self._cpu = read_metrics(self.c), server_cpu(self.api_pid)
        self._t, self.block.load = time.perf_counter(), (loadavg(), 0.0)
        return self.block

    def __exit__(self, *exc: object) -> None:
        b = self.block
        b.wall_s = round(time.perf_counter() - self._t, 3)
        b.cpu_s = {k: round(v, 3) for k, v in {**cpu_delta(self._cpu, server_cpu(self.api_pid)),
                                                "flood_clients": b.cpu_s.get("flood_clients", 0.0)}.items()}
        after = read_metrics(self.c)
        b.steps = {w: histogram_delta(self._metrics, after, "kvfuse_engine_step_seconds", f'work="{w}"')
                   for w in ("query", "ingest")}
        b.loop_lag = histogram_delta(self._metrics, after, "kvfuse_event_loop_lag_seconds")
        b.load = (b.load[0], loadavg())


def summarize_blocks(blocks: list[Block]) -> dict[str, Any]:
    """Per phase: cores used by each process (CPU seconds over the phase's wall time), the engine steps,
    the loop lag, and the mean of each part of a query's time (ms)."""
    out: dict[str, Any] = {}
    for phase in ("quiet", "flood"):
        mine = [b for b in blocks if b.phase == phase]
        wall = sum(b.wall_s for b in mine)
        if not mine or wall <= 0:
            continue
        cores = {k: round(sum(b.cpu_s.get(k, 0.0) for b in mine) / wall, 3)
                 for k in ("api", "worker", "parse", "flood_clients")}
        steps = {}
        for w in ("query", "ingest"):
            n = sum(b.steps[w]["n"] for b in mine)
            total = sum(b.steps[w]["sum_s"] for b in mine)
            steps[w] = {"n": n, "mean_s": round(total / n, 5) if n else None,
                        "per_s": round(n / wall, 2), "busy_share": round(total / wall, 3)}
        lag_n = sum(b.loop_lag["n"] for b in mine)
        timings = [t for b in mine for t in b.timings]
        out[phase] = {
            "wall_s": round(wall, 1), "cores": cores, "steps": steps,
            "loop_lag_mean_s": round(sum(b.loop_lag["sum_s"] for b in mine) / lag_n, 5) if lag_n else None,
            "loop_lag_p99_le_s": max((b.loop_lag["p99_le_s"] for b in mine if b.loop_lag["n"]),
                                     key=lambda v: float("inf") if v == "inf" else v, default=None),
            "query_parts_mean_ms": {p: round(sum(t.get(p, 0.0) for t in timings) / len(timings), 1)
                                    for p in TIMING_PARTS} if timings else {},
            # the client's latency beyond the server's own total: HTTP, the API's loop, the client itself
            "client_over_server_ms": round(1000 * sum(sum(b.queries_s) for b in mine) / len(timings)
                                           - sum(t.get("total_ms", 0.0) for t in timings) / len(timings), 1)
            if timings else None,
            "flood_requests_per_s": round(sum(b.flood_requests for b in mine) / wall, 1),
            "load": [min(x for b in mine for x in b.load), max(x for b in mine for x in b.load)],
        }
    return out


def plot(payload: dict[str, Any], path: Path) -> Path:
    """Left: every query's latency by block, quiet and flood, the p95 of each kind as a line. Right: the
    cores each process used per phase (CPU seconds over wall time), the flood's own clients included."""
    from kvfuse.bench.plots import _save, pyplot

    plt = pyplot()
    result = payload["result"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"quiet": "tab:blue", "flood": "tab:red"}
    for i, block in enumerate(result["blocks"]):
        xs = [i + (j + 1) / (len(block["queries_s"]) + 1) for j in range(len(block["queries_s"]))]
        left.scatter(xs, block["queries_s"], s=14, color=colors[block["phase"]])
    for phase in ("quiet", "flood"):
        left.axhline(result[f"p95_{phase}_s"], color=colors[phase], ls="--", lw=1, label=f"{phase} p95")
    left.set_xlabel("block (in the order run)")
    left.set_ylabel("query latency, s")
    left.set_title(f"query p95 flood / quiet = {result['p95_ratio']:.2f}x")
    left.legend(fontsize=8)
    where = result["where_time_went"]
    parts = ("api", "worker", "parse", "flood_clients")
    bottom = [0.0, 0.0]
    for part in parts:
        values = [where[p]["cores"][part] for p in ("quiet", "flood")]
        right.bar(["quiet", "flood"], values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    right.axhline(payload["machine"].get("cpu_cores", 2), color="k", lw=1, ls=":", label="the machine's cores")
    right.set_ylabel("cores used (CPU s / wall s)")
    right.set_title("who used the CPU")
    right.legend(fontsize=8)
    fig.suptitle(payload["command"], fontsize=7)
    fig.tight_layout()
    return _save(plt, fig, path)
