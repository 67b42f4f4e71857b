"""A query's load holds its transient KV in the one ledger (kvfuse/fusion/engine/ledger.py, `transient`):
its chunks in no tier, computed at first use (the model's own cache beside the buffer, and each computed
chunk until it is at rest), and its system prompt's forward. In the whole worker with the real default
model: a query whose load does not fit beside what runs waits for the room (Scheduler.requeue), the
ledger within the budget at every step, and is answered as it is alone; one whose load could never fit
beside its own prompt is refused, saying so. docs/DESIGN.md, "One device-memory ledger"."""

from __future__ import annotations

import pytest
from test_scheduler_worker import MODEL_CACHE, essay_chunks, query

from kvfuse.config import load_settings
from kvfuse.service.wire import protocol as P
from kvfuse.service.worker.chunk_kv import forward_peak
from kvfuse.service.worker.core import WorkerCore

pytestmark = pytest.mark.slow


def _worker(tmp_path_factory: pytest.TempPathFactory, budget: int) -> WorkerCore:
    root = tmp_path_factory.mktemp("load-room")
    settings = load_settings(data_dir=root / "data", model_cache_dir=MODEL_CACHE, log_level="warning",
                             model={"max_context_tokens": 4096, "threads": 1},
                             server={"max_running_requests": 4, "kv_budget_tokens": budget})
    sent: list = []
    w = WorkerCore(settings, sent.append)
    w.sent = sent
    return w


def _jobs(chunks: list[list[int]]) -> tuple[P.QueryJob, P.QueryJob]:
    """A: two cold chunks and a long answer; B: four cold chunks (computed in its load) and a short one."""
    a = query(chunks, [0, 1], max_tokens=40)
    a.job_id = 1
    b = query(chunks, [2, 3, 4, 5], max_tokens=6)
    b.job_id = 2
    return a, b


@pytest.fixture(scope="module")
def sizes(tmp_path_factory, essays, default_llm_path) -> dict[str, int]:
    """Each query's extent and B's load, read off a worker with room for everything."""
    chunks = essay_chunks(essays, default_llm_path, 6)
    w = _worker(tmp_path_factory, 3000)
    try:
        a, b = _jobs(chunks)
        assert w.receive(a) and w.receive(b)
        waiting = {r.job_id: r.kv_tokens for r in w.core.scheduler.waiting}
        load_b = w.kv.compute_peak(chunks[2:6], [[]] * 4)
        lengths = [len(c) for c in chunks[2:6]]  # four chunks alone: one padded batch beside its four outputs
        assert load_b == forward_peak(lengths, [0] * 4, w.engine.precompute_batch_tokens) + sum(lengths)
        return {"a": waiting[1], "b": waiting[2], "load_b": load_b}
    finally:
        w.store.close()


def _run(w: WorkerCore) -> list:
    """Step until idle, checking at every step that what the ledger counts, and what the extents and the
    prefix cache really hold, are within the budget."""
    budget = w.core.ledger.budget_bytes
    while w.has_work:
        w.step()
        assert w.core.ledger.used_bytes() <= budget
        assert w.core.memory.extent_bytes + w.kv.prefix_bytes() <= budget
    return list(w.sent)


def test_a_load_that_does_not_fit_beside_what_runs_waits_and_answers_as_alone(
        tmp_path_factory, essays, default_llm_path, sizes) -> None:
    chunks = essay_chunks(essays, default_llm_path, 6)
    # room for both extents and for B's load alone, not for both extents and B's load at once
    budget = sizes["a"] + sizes["b"] + sizes["load_b"] - 16
    assert sizes["b"] + sizes["load_b"] < budget - 64
    w = _worker(tmp_path_factory, budget)
    try:
        a, b = _jobs(chunks)
        assert w.receive(b)
        alone = next(m for m in _run(w) if isinstance(m, P.Result))
        w.sent.clear()
        assert w.receive(a)
        while not any(isinstance(m, P.Delta) and m.job_id == 1 for m in w.sent):  # A decodes
            w.step()
        assert w.receive(b)
        out = _run(w)
        results = [m.job_id for m in out if isinstance(m, P.Result)]
        assert results == [1, 2]  # B waited for A's room
        got = next(m for m in out if isinstance(m, P.Result) and m.job_id == 2)
        assert got.text == alone.text and got.usage["chunks_computed"] == 4
        assert sum(isinstance(m, P.Plan) and m.job_id == 2 for m in out) == 1  # announced once
        peaks = w.core.ledger.report().peak_holders
        assert peaks["load"] >= sizes["load_b"] * w.core.memory.token_bytes  # B's load was held in the ledger
        assert w.core.ledger.holders()["load"] == 0
        assert w.core.ledger.peak_bytes <= w.core.ledger.budget_bytes
    finally:
        w.store.close()


def test_a_load_that_could_never_fit_beside_its_prompt_is_refused(
        tmp_path_factory, essays, default_llm_path, sizes) -> None:
    chunks = essay_chunks(essays, default_llm_path, 6)
    w = _worker(tmp_path_factory, sizes["b"] + sizes["load_b"] - 16)
    try:
        _, b = _jobs(chunks)
        assert w.receive(b)
        out = _run(w)
        err = next(m for m in out if isinstance(m, P.Error))
        assert err.job_id == 2 and err.kind == P.ERR_KV_BUDGET, err
        assert "computing 4 chunks needs" in err.message and "server.kv_budget_tokens" in err.message
        assert not any(isinstance(m, P.Result) for m in out)
        assert w.core.ledger.holders()["load"] == 0 and w.core.memory.extent_tokens == 0
    finally:
        w.store.close()
