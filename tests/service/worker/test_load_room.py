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


def _jobs(chunks: list[list[int]], method: str) -> tuple[P.QueryJob, P.QueryJob]:
    """A: two cold chunks and a long answer; B (`method`): four cold chunks (computed in its load, samkv's
    too: ChunkCache.block_sources) and a short one."""
    a = query(chunks, [0, 1], max_tokens=40)
    a.job_id = 1
    b = query(chunks, [2, 3, 4, 5], method=method, max_tokens=6)
    b.job_id = 2
    return a, b


def _sizes(tmp_path_factory: pytest.TempPathFactory, chunks: list[list[int]], method: str) -> dict:
    """Each query's extent and B's load, read off a worker with room for everything (B by `method`)."""
    w = _worker(tmp_path_factory, 3000)
    try:
        a, b = _jobs(chunks, method)
        assert w.receive(a) and w.receive(b)
        waiting = {r.job_id: r.kv_tokens for r in w.core.scheduler.waiting}
        load_b = w.kv.compute_peak(chunks[2:6], [[]] * 4)
        lengths = [len(c) for c in chunks[2:6]]  # four chunks alone: one padded batch beside its four outputs
        batch = min(4 * max(lengths), max(w.engine.precompute_batch_tokens, max(lengths)))
        assert load_b == batch + sum(lengths)
        return {"a": waiting[1], "b": waiting[2], "load_b": load_b, "method": method}
    finally:
        w.store.close()


@pytest.fixture(scope="module", params=["anchor", "samkv"])
def sizes(request, tmp_path_factory, essays, default_llm_path) -> dict:
    return _sizes(tmp_path_factory, essay_chunks(essays, default_llm_path, 6), request.param)


def _run(w: WorkerCore) -> list:
    """Step until idle, checking at every step that what the ledger counts, and what the extents and the
    prefix cache really hold, are within the budget."""
    budget = w.core.ledger.budget_bytes
    while w.has_work:
        w.step()
        assert w.core.ledger.used_bytes() <= budget
        assert w.core.memory.extent_bytes + w.kv.prefixes.nbytes() <= budget
    return list(w.sent)


def test_a_load_that_does_not_fit_beside_what_runs_waits_and_answers_as_alone(
        tmp_path_factory, essays, default_llm_path, sizes) -> None:
    chunks = essay_chunks(essays, default_llm_path, 6)
    # room for both extents and for B's load alone, not for both extents and B's load at once
    budget = sizes["a"] + sizes["b"] + sizes["load_b"] - 16
    assert sizes["b"] + sizes["load_b"] < budget - 64
    w = _worker(tmp_path_factory, budget)
    try:
        a, b = _jobs(chunks, sizes["method"])
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
        _, b = _jobs(chunks, sizes["method"])
        assert w.receive(b)
        out = _run(w)
        err = next(m for m in out if isinstance(m, P.Error))
        assert err.job_id == 2 and err.kind == P.ERR_KV_BUDGET, err
        assert "computing 4 chunks needs" in err.message and "server.kv_budget_tokens" in err.message
        assert not any(isinstance(m, P.Result) for m in out)
        assert w.core.ledger.holders()["load"] == 0 and w.core.memory.extent_tokens == 0
    finally:
        w.store.close()


def test_a_chunk_samkv_finds_gone_in_its_prefill_waits_for_the_room_to_compute_it(
        tmp_path_factory, essays, default_llm_path) -> None:
    """samkv reads a stored chunk block by block during its prefill; one evicted after its load found it
    is computed then (ChunkCache.block_source's fallback), its forward counted in the ledger: without the
    room beside what runs, the query goes back to wait (as a load does) and its next load computes it."""
    chunks = essay_chunks(essays, default_llm_path, 6)
    sizes = _sizes(tmp_path_factory, chunks, "samkv")
    one = 2 * len(chunks[2])  # a chunk alone computed: its forward's cache beside the chunk computed
    w = _worker(tmp_path_factory, sizes["a"] + sizes["b"] + one - 16)
    try:
        assert w.kv.compute_peak([chunks[2]], [[]]) == one
        assert w.receive(P.PrecomputeJob(chunks=chunks[2:6], job_id=7))
        _run(w)
        a, b = _jobs(chunks, "samkv")
        b.chunks = [P.ChunkRef(w.kv.key_of(c), c, 1.0) for c in chunks[2:6]]  # stored: read block by block
        assert w.receive(b)
        alone = next(m for m in _run(w) if isinstance(m, P.Result))
        assert alone.usage["chunks_computed"] == 0 and alone.usage["chunks_read"] == 4
        w.sent.clear()
        assert w.receive(a)
        while not any(isinstance(m, P.Delta) and m.job_id == 1 for m in w.sent):  # A decodes
            w.step()
        assert w.receive(b)
        w.step()  # B admitted and loaded: every chunk found stored
        assert w.core.scheduler.running[2].seq is not None and not w.core.scheduler.waiting
        assert w.store.chunks.remove(b.chunks[0].key)  # evicted before B's prefill reads it
        out = _run(w)
        assert [m.job_id for m in out if isinstance(m, P.Result)] == [1, 2]  # B waited for A's room
        got = next(m for m in out if isinstance(m, P.Result) and m.job_id == 2)
        assert got.text == alone.text and got.usage["chunks_computed"] == 1, got
        assert sum(isinstance(m, P.Plan) and m.job_id == 2 for m in out) == 1  # announced once
        assert w.core.ledger.report().peak_holders["load"] >= one * w.core.memory.token_bytes
        assert w.core.ledger.holders()["load"] == 0 and w.core.ledger.peak_bytes <= w.core.ledger.budget_bytes
    finally:
        w.store.close()


def test_a_system_prompt_whose_forward_does_not_fit_beside_what_runs_waits_and_stays_cached(
        tmp_path_factory, essays, default_llm_path) -> None:
    """A system prompt not cached yet: its entry held and its forward's cache counted beside it while it
    runs (PrefixCache), twice its tokens; without that room the query waits (as a load does), and once
    answered its entry stays held in the ledger, in whole tokens."""
    chunks = essay_chunks(essays, default_llm_path, 6)
    a, _ = _jobs(chunks, "anchor")
    b = query(chunks, [2], max_tokens=6, system_prompt=" ".join(["Answer briefly, from the documents."] * 40))
    b.job_id = 2
    w = _worker(tmp_path_factory, 3000)
    try:
        assert w.receive(b)
        ext_b, prefix_ids = w.core.scheduler.waiting[0].kv_tokens, w.core.scheduler.waiting[0].seq.prefix_ids
        alone = next(m for m in _run(w) if isinstance(m, P.Result))
        assert w.receive(a)
        ext_a = w.core.scheduler.waiting[0].kv_tokens
    finally:
        w.store.close()
    n = len(prefix_ids)
    assert 2 * n > 2 * len(chunks[2])  # the prompt's room, not the cold chunk's, is what B waits for
    w = _worker(tmp_path_factory, ext_a + ext_b + 2 * n - 16)
    try:
        assert w.receive(a)
        while not any(isinstance(m, P.Delta) and m.job_id == 1 for m in w.sent):  # A decodes
            w.step()
        assert w.receive(b)
        out = _run(w)
        assert [m.job_id for m in out if isinstance(m, P.Result)] == [1, 2]  # B waited for A's room
        got = next(m for m in out if isinstance(m, P.Result) and m.job_id == 2)
        assert got.text == alone.text
        assert w.core.ledger.report().peak_holders["load"] >= n * w.core.memory.token_bytes  # its forward
        assert w.core.ledger.holders()["load"] == 0 and w.core.ledger.peak_bytes <= w.core.ledger.budget_bytes
        held = w.core.memory.holds[("prefix", w.kv.key_of(prefix_ids))].tokens
        assert held == -(-w.kv.prefixes.get(prefix_ids).k.nbytes * 2 // w.core.memory.token_bytes) == n  # kept
    finally:
        w.store.close()


def test_a_load_that_waits_for_its_room_reads_nothing_before_it_waits(tmp_path_factory, essays, default_llm_path) -> None:
    """The room for the chunks a load computes whatever its reads find (those in no tier) is held before
    any read (ChunkCache.load_all): a query that must wait for it reads its stored chunks once, after."""
    chunks = essay_chunks(essays, default_llm_path, 6)
    a, b = _jobs(chunks, "anchor")
    w = _worker(tmp_path_factory, 3000)
    try:
        assert w.receive(P.PrecomputeJob(chunks=chunks[2:4], job_id=7))
        _run(w)
        # B: two stored chunks (read) and two in no tier (computed in its load)
        b.chunks = [P.ChunkRef(w.kv.key_of(c), c, 1.0) for c in chunks[2:4]] + b.chunks[2:]
        assert w.receive(a) and w.receive(b)
        ext = {r.job_id: r.kv_tokens for r in w.core.scheduler.waiting}
    finally:
        w.store.close()
    load = 2 * max(map(len, chunks[4:6])) + sum(map(len, chunks[4:6]))  # a padded batch of two, and both computed
    w = _worker(tmp_path_factory, ext[1] + ext[2] + load - 16)
    try:
        assert w.receive(P.PrecomputeJob(chunks=chunks[2:4], job_id=7))
        _run(w)
        assert w.receive(a)
        while not any(isinstance(m, P.Delta) and m.job_id == 1 for m in w.sent):  # A decodes
            w.step()
        served = dict(w.store.chunks.hits)  # reads per tier ("miss": found in none)
        assert w.receive(b)
        out = _run(w)
        assert [m.job_id for m in out if isinstance(m, P.Result)][-2:] == [1, 2]  # B waited for A's room
        got = next(m for m in out if isinstance(m, P.Result) and m.job_id == 2)
        assert got.usage["chunks_computed"] == 2 and got.usage["chunks_read"] == 2
        reads = {tier: n - served.get(tier, 0) for tier, n in w.store.chunks.hits.items()}
        assert reads["lmdb"] + reads["hot"] == 2 and reads["miss"] == 2, reads  # each of B's chunks looked up once
    finally:
        w.store.close()
