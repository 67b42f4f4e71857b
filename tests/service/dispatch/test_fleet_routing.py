"""The fleet's query routing policy (kvfuse.service.dispatch.routing): locality weighed against load."""

from __future__ import annotations

from kvfuse.config import FleetSettings
from kvfuse.service.dispatch.routing import Candidate, pick_worker

WEIGHT = FleetSettings().route_load_weight  # the documented default


def test_a_loaded_holder_spills_to_an_idle_worker_that_holds_nothing() -> None:
    idle = Candidate("b", held=0, jobs=0, slots=16)
    assert pick_worker([Candidate("a", held=3, jobs=0, slots=16), idle], 3, WEIGHT) == "a"
    assert pick_worker([Candidate("a", held=3, jobs=1, slots=16), idle], 3, WEIGHT) == "a"  # locality is worth a job
    assert pick_worker([Candidate("a", held=3, jobs=2, slots=16), idle], 3, WEIGHT) == "b"  # not two


def test_six_queries_at_once_end_on_both_workers() -> None:
    """The reported case: every chunk on a, six queries at once, b idle (and holding what it took)."""
    held, jobs = {"a": 3, "b": 0}, {"a": 0, "b": 0}
    for _ in range(6):
        wid = pick_worker([Candidate(w, held[w], jobs[w], 16) for w in ("a", "b")], 3, WEIGHT)
        jobs[wid] += 1
        held[wid] = 3  # a worker holds a query's chunks once it has taken it (the shared tier gave them)
    assert jobs == {"a": 3, "b": 3}


def test_locality_decides_among_equally_loaded_workers_and_partial_holdings_count() -> None:
    cands = [Candidate("a", held=1, jobs=1, slots=16), Candidate("b", held=2, jobs=1, slots=16),
             Candidate("c", held=0, jobs=1, slots=16)]
    assert pick_worker(cands, 4, WEIGHT) == "b"


def test_weight_zero_is_locality_alone_until_the_holder_is_full() -> None:
    idle = Candidate("b", held=0, jobs=0, slots=16)
    assert pick_worker([Candidate("a", held=3, jobs=15, slots=16), idle], 3, 0.0) == "a"
    assert pick_worker([Candidate("a", held=3, jobs=16, slots=16), idle], 3, 0.0) == "b"


def test_load_is_relative_to_a_workers_slots() -> None:
    big, small = Candidate("big", held=0, jobs=8, slots=64), Candidate("small", held=0, jobs=1, slots=4)
    assert pick_worker([small, big], 2, WEIGHT) == "big"


def test_no_worker_with_room_means_the_shared_stream() -> None:
    full = [Candidate("a", held=3, jobs=2, slots=2), Candidate("b", held=0, jobs=4, slots=2)]
    assert pick_worker(full, 3, WEIGHT) is None
    assert pick_worker([], 3, WEIGHT) is None


def test_a_query_without_chunks_goes_to_the_least_loaded() -> None:
    assert pick_worker([Candidate("a", 0, 3, 16), Candidate("b", 0, 1, 16)], 0, WEIGHT) == "b"
