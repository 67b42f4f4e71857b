"""Which `kvfuse worker` a query goes to: chunk locality weighed against load (pure policy, no I/O).

A worker that already holds a query's chunks (in RAM or its LMDB) serves them without reading the shared
tier, but sending every query there leaves the other workers idle while it queues: the shared tier makes
every chunk available to every worker, so locality is worth a little, never a queue. Routers of LLM
fleets settle this two ways: SGLang's cache-aware router follows the longest cached prefix until the
load is imbalanced past fixed thresholds, then takes the shortest queue; vLLM's production-stack
load-aware router scores each replica as its cached share of the prompt minus a weight times its load.
kvfuse takes the score, which needs one setting and has no jump at a threshold:

    score(w) = held(w) / chunks  -  fleet.route_load_weight * jobs(w) / max_running_requests(w)

`held` counts the query's chunks the worker reports holding (`holds:<worker>`), `jobs` the dispatcher's
own jobs at the worker (sent to it or taken by it, not finished: exact at once, where a heartbeat lags
by up to `fleet.heartbeat_s`), and dividing by the worker's running slots makes a large worker cheaper
to add to than a small one. The best score wins; ties go to the less loaded, then to the one holding
more. A worker whose slots are all taken is not a candidate; when none has room the query goes to the
shared stream, where the first worker to free a slot takes it. With a weight of 0 locality alone
decides (the worker holding most of the chunks while it has room), as the fleet routed before load
counted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """One live worker as the router sees it for one query."""

    id: str
    held: int  # the query's chunks it holds
    jobs: int  # the dispatcher's jobs at it, not finished
    slots: int  # its max_running_requests (from its heartbeat)

    @property
    def load(self) -> float:
        return self.jobs / max(1, self.slots)


def pick_worker(candidates: list[Candidate], chunks: int, load_weight: float) -> str | None:
    """The worker to send a query of `chunks` chunks to, or None for the shared stream (no room)."""
    best, best_key = None, None
    for c in candidates:
        if c.jobs >= c.slots:
            continue
        locality = c.held / chunks if chunks else 0.0
        key = (locality - load_weight * c.load, -c.load, c.held)
        if best_key is None or key > best_key:
            best, best_key = c.id, key
    return best
