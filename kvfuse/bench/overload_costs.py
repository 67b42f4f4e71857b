"""What one refused request costs the API process, by kind, for `kvfuse bench overload`.

Each kind is measured as a margin, so that what holds the refusal's condition is not counted: a window
of the holders alone, then a window of the holders plus one more thread sending that kind; the API
process's CPU seconds (/proc) between them over the refusals between them. Kinds: 413
`body_too_large` and 429 `ingest_queue_full` (nothing to hold: the margin is over an idle window; the
thread sending batches fills its key's share of the queue itself, and the few it gets accepted are
counted in) and 429 `parsers_busy` (three
threads uploading the amplifying DOCX keep the parse process and its waiters' places taken; the probe
sends small uploads). A request the margin's thread got accepted costs more than a refusal: the counts
are reported beside the cost, which is an upper bound when some were accepted. The flood threads' own
CPU is reported the same way (the client's side of a refusal, on this machine).
"""

from __future__ import annotations

import time
from typing import Any

from kvfuse.bench.overload_flood import FLOOD_KEYS, Flood, OverloadConfig, Tally, wait_jobs
from kvfuse.bench.overload_meter import cpu_s

# kind -> (the refusal's status and code, the holders' senders, the margin's sender)
_KINDS: dict[str, tuple[tuple[int, str], tuple, tuple]] = {
    "413 body_too_large": ((413, "body_too_large"), (), (FLOOD_KEYS[0], ("oversize",), 1)),
    "429 ingest_queue_full": ((429, "ingest_queue_full"), (), (FLOOD_KEYS[0], ("batch",), 1)),
    "429 parsers_busy": ((429, "parsers_busy"), ((FLOOD_KEYS[1], ("amplifier",), 3),),
                         (FLOOD_KEYS[0], ("upload",), 1)),
}


def _window(cfg: OverloadConfig, amplifier: bytes, senders: tuple, jobs: list[str]) -> dict[str, Any]:
    """One window of `senders` (none: idle): the API's CPU seconds, the clients', the answers."""
    tally = Tally()
    before, t = cpu_s(cfg.api_pid), time.perf_counter()
    if senders:
        with Flood(cfg.url, tally, clients=0, uploaders=0, batch=cfg.batch, amplifier=amplifier,
                   body_limit=cfg.server["max_body_bytes"], senders=senders, fair=False):
            time.sleep(cfg.cost_window_s)
    else:
        time.sleep(cfg.cost_window_s)
    jobs += tally.jobs
    return {"wall_s": time.perf_counter() - t, "api_cpu_s": cpu_s(cfg.api_pid) - before,
            "client_cpu_s": tally.client_cpu_s, "answers": tally.answers}


def refusal_costs(cfg: OverloadConfig, amplifier: bytes, tally: Tally) -> dict[str, Any]:
    """Per kind: the API's and the clients' CPU milliseconds per refusal at the margin, and the counts.
    Jobs the windows got accepted join `tally.jobs` (they must end ready too)."""
    out: dict[str, Any] = {"window_s": cfg.cost_window_s}
    idle = _window(cfg, amplifier, (), tally.jobs)
    out["api_idle_cores"] = round(idle["api_cpu_s"] / idle["wall_s"], 3)
    for kind, (refusal, holders, extra) in _KINDS.items():
        base = _window(cfg, amplifier, holders, tally.jobs) if holders else idle
        more = _window(cfg, amplifier, (*holders, extra), tally.jobs)
        out[kind] = margin(base, more, refusal)
        wait_jobs(cfg.url, tally.jobs, 120.0)  # the next kind starts with the queue as empty as this one did
    return out


def margin(base: dict[str, Any], more: dict[str, Any], refusal: tuple[int, str]) -> dict[str, Any]:
    """The cost of the refusals `more` had beyond `base` (the base window's rates scaled to `more`'s wall
    time): the API's and the clients' CPU milliseconds per refusal at the margin, and the counts."""
    scale = more["wall_s"] / base["wall_s"]
    refused = _count(more, refusal) - _count(base, refusal) * scale
    api = more["api_cpu_s"] - base["api_cpu_s"] * scale
    client = more["client_cpu_s"] - base["client_cpu_s"] * scale
    return {"api_cpu_ms_per_refusal": round(1000 * api / refused, 3) if refused > 0 else None,
            "client_cpu_ms_per_refusal": round(1000 * client / refused, 3) if refused > 0 else None,
            "refusals_at_margin": round(refused, 1),
            "answers_base": _answers(base), "answers_with_margin": _answers(more)}


def _count(window: dict[str, Any], refusal: tuple[int, str]) -> int:
    return sum(n for (_, status, code), n in window["answers"].items() if (status, code) == refusal)


def _answers(window: dict[str, Any]) -> dict[str, int]:
    return {f"{k} {s} {code}".strip(): n for (k, s, code), n in sorted(window["answers"].items())}
