"""The worker without a transport (kvfuse/service/worker/core.py): wire messages in as calls, messages out
through the `send` it is given, in this process. The same WorkerCore runs behind the pipe of the local
worker and the Redis streams of a fleet worker, so this is the whole worker, tested without a process:
ingestion, queries batched together, cancellation, the engine step's report and the KV memory it holds."""

from __future__ import annotations

import pytest
from test_first_use import blobs
from test_scheduler_worker import MODEL_CACHE, essay_chunks, query

from kvfuse.config import load_settings
from kvfuse.service.wire import protocol as P
from kvfuse.service.worker.core import WorkerCore

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("worker-core")
    settings = load_settings(data_dir=root / "data", model_cache_dir=MODEL_CACHE, log_level="warning",
                             model={"max_context_tokens": 4096, "threads": 1},
                             server={"max_running_requests": 4, "kv_budget_tokens": 3000, "prefill_tokens_per_step": 256})
    sent: list = []
    w = WorkerCore(settings, sent.append)
    w.sent = sent
    yield w
    w.store.close()


def drive(w: WorkerCore, *msgs) -> list:
    """Hand `msgs` to the worker and step it until it has nothing to do; the messages it sent meanwhile."""
    w.sent.clear()
    for m in msgs:
        assert w.receive(m)
    while w.has_work:
        w.step()
    return list(w.sent)


def test_ingest_then_queries_batched_and_cancelled(worker, essays, default_llm_path) -> None:
    chunks = essay_chunks(essays, default_llm_path, 4)
    out = drive(worker, P.PrecomputeJob(chunks=chunks, job_id=1))
    done = next(m for m in out if isinstance(m, P.Done))
    assert done.computed == 4 and len(done.keys) == 4 and done.worker == worker.name
    # each piece's forward cache was reserved in the KV memory, within its budget
    assert 0 < worker.core.ingest_kv_peak <= worker.core.memory.capacity

    jobs = []
    for i, picks in enumerate([[0, 1], [2], [3, 0]]):
        job = query(chunks, picks, max_tokens=6)
        job.chunks = [P.ChunkRef(done.keys[p], chunks[p], 1.0) for p in picks]
        job.job_id = 10 + i
        jobs.append(job)
    out = drive(worker, *jobs)
    for job in jobs:
        mine = [m for m in out if getattr(m, "job_id", None) == job.job_id]
        assert isinstance(mine[0], P.Plan) and isinstance(mine[-1], P.Result), mine
        assert mine[-1].usage["generated_tokens"] >= 1 and mine[-1].rebuilt_chunks == 0
        assert mine[-1].kv_reads.get("lmdb", 0) + mine[-1].kv_reads.get("hot", 0) == len(job.chunks)
    steps = [m for m in out if isinstance(m, P.Step)]
    assert max(s.batch_size for s in steps) == 3  # the three decoded together
    assert all(s.seconds > 0 for s in steps)  # each step's wall time (kvfuse_engine_step_seconds)
    budget_bytes = worker.info()["kv_budget_bytes"]
    assert all(0 <= s.kv_bytes <= budget_bytes for s in steps) and max(s.kv_bytes for s in steps) > 0
    assert steps[-1].kv_bytes == 0 and worker.core.memory.extent_tokens == 0  # every extent given back
    # what stays is the cached system prompt's hold, in whole tokens (the one ledger: engine/ledger.py)
    assert worker.core.memory.held_tokens == -(-worker.kv.prefixes.nbytes() // worker.core.memory.token_bytes) > 0

    # a cancel while decoding ends it with a result; one of a job the worker no longer has is ignored
    long = query(chunks, [1], max_tokens=64)
    long.chunks = [P.ChunkRef(done.keys[1], chunks[1], 1.0)]
    long.job_id = 20
    worker.sent.clear()
    worker.receive(long)
    while not any(isinstance(m, P.Delta) for m in worker.sent):
        worker.step()
    out = drive(worker, P.Cancel(20), P.Cancel(99))
    assert [m.finish_reason for m in out if isinstance(m, P.Result)] == ["cancelled"]


def test_a_query_that_can_never_fit_is_refused_at_once(worker, essays, default_llm_path) -> None:
    chunks = essay_chunks(essays, default_llm_path, 2)
    job = query(chunks, [0, 1], max_tokens=3000)
    job.job_id = 30
    out = drive(worker, job)
    assert len(out) == 1 and isinstance(out[0], P.Error) and out[0].kind in (P.ERR_KV_BUDGET, P.ERR_MAX_TOKENS)


def _texts(out: list, job_id: int) -> dict[int, str]:
    """Each choice's text as its Deltas carried it."""
    texts: dict[int, str] = {}
    for m in out:
        if isinstance(m, P.Delta) and m.job_id == job_id:
            texts[m.index] = texts.get(m.index, "") + m.text
    return texts


def test_n_choices_come_from_one_prefill_each_a_solo_run_with_its_seed(worker, essays, default_llm_path) -> None:
    """n = 3 sampled with a seed: one Plan, Deltas per choice that reassemble to the Result's choices, each
    choice the answer of an n = 1 job with seed + index, usage summed, the KV memory within its budget."""
    chunks = essay_chunks(essays, default_llm_path, 2)
    sampled = {"max_tokens": 8, "temperature": 1.0, "top_p": 0.95, "logprobs": 0}
    job = query(chunks, [0, 1], **{**sampled, "seed": 5})
    job.job_id, job.n = 40, 3
    out = drive(worker, job)
    mine = [m for m in out if getattr(m, "job_id", None) == 40]
    assert [type(m) for m in mine if not isinstance(m, P.Delta)] == [P.Plan, P.Result]
    result = mine[-1]
    answers = {0: result.text, **{c["index"]: c["text"] for c in result.choices}}
    assert _texts(out, 40) == answers and sorted(answers) == [0, 1, 2]
    solo = []
    for i in range(3):
        alone = query(chunks, [0, 1], **{**sampled, "seed": 5 + i})
        alone.job_id = 41 + i
        solo.append(next(m for m in drive(worker, alone) if isinstance(m, P.Result)))
    assert [answers[i] for i in range(3)] == [s.text for s in solo]
    assert len(set(answers.values())) > 1  # sampled choices differ
    lengths = [result.usage["generated_tokens"] - sum(c["generated_tokens"] for c in result.choices),
               *(c["generated_tokens"] for c in result.choices)]
    assert lengths == [s.usage["generated_tokens"] for s in solo]  # usage: the sum over choices
    assert [len(result.logprobs), *(len(c["logprobs"]) for c in result.choices)] == lengths
    assert result.usage["context_tokens"] == solo[0].usage["context_tokens"]  # the prompt counted once
    steps = [m for m in out if isinstance(m, P.Step)]
    budget = worker.info()["kv_budget_bytes"]
    assert all(s.kv_bytes <= budget for s in steps) and max(s.batch_size for s in steps) == 3
    assert worker.core.memory.extent_tokens == 0


def test_n_choices_that_cannot_fit_together_are_refused_naming_n(worker, essays, default_llm_path) -> None:
    chunks = essay_chunks(essays, default_llm_path, 2)
    job = query(chunks, [0, 1], max_tokens=900)  # one fits the 3000-token budget, three do not
    job.job_id, job.n = 50, 3
    out = drive(worker, job)
    assert len(out) == 1 and out[0].kind == P.ERR_CHOICES and "n=3" in out[0].message, out
    job = query(chunks, [0], max_tokens=4)
    job.job_id, job.n = 51, 5  # more rows than max_running_requests (4)
    out = drive(worker, job)
    assert len(out) == 1 and out[0].kind == P.ERR_CHOICES
    assert worker.core.memory.extent_tokens == 0 and not worker.has_work


def test_an_ingestion_piece_reserves_its_forwards_padded_cache_and_its_outputs(worker, essays, default_llm_path) -> None:
    """IngestTask.need is ChunkCache.compute_peak over the piece, as a query's load counts its cold chunks:
    chunks alone are batched padded to the longest (at most fusion.precompute_batch_tokens), chunks after
    a context hold their context too, and every chunk computed is held beside the largest forward; a piece
    is what fits the step's budget (at least one chunk), and what is stored already needs nothing."""
    from kvfuse.service.worker.sequences import IngestTask

    ids = [t for c in essay_chunks(essays, default_llm_path, 4) for t in c]
    chunks = [ids[:40], ids[40:110], ids[110:200]]  # 40, 70 and 90 tokens
    alone = IngestTask(P.PrecomputeJob(chunks=chunks, job_id=60))
    assert alone.need(worker.kv, 10_000) == 3 * 90 + 200 and alone.need(worker.kv, 100) == 40 + 40  # a piece of one
    assert alone.need(worker.kv, 115) == 2 * 70 + 110  # 40 + 70 fit the budget: padded to the longer
    after = IngestTask(P.PrecomputeJob(chunks=chunks[:2], job_id=61, contexts=[[], chunks[0]]))
    assert after.need(worker.kv, 10_000) == max(40, 40 + 70) + 110
    drive(worker, P.PrecomputeJob(chunks=chunks, job_id=62))
    stored = IngestTask(P.PrecomputeJob(chunks=chunks, job_id=63))
    assert stored.need(worker.kv, 10_000) == 0 and isinstance(stored.run_piece(worker.kv, 10_000), P.Done)


def test_a_query_arriving_mid_piece_waits_for_one_slice_of_layers(worker, essays, default_llm_path) -> None:
    """An ingestion piece runs `server.ingest_layers_per_step` decoder layers per engine step (counted on
    the model's own layers): a query arriving while a piece of 30 layers is in flight takes its first token
    after at most one more slice of it, not the rest of the piece; the piece resumes from where it paused
    with its memory held, and stores the KV an unpaused precompute gives, byte for byte. Cancelled in
    flight, a job gives its memory back and leaves no forward running."""
    import threading

    def pause_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "kvfuse-layer-steps"]

    slice_ = worker.settings.server.ingest_layers_per_step
    layers = worker.engine.num_layers
    assert 0 < slice_ < layers
    ran: list[int] = []  # one entry per decoder layer a paused forward completed

    def count(_module, _args, _out) -> None:
        if threading.current_thread().name == "kvfuse-layer-steps":
            ran.append(1)

    hooks = [layer.register_forward_hook(count) for layer in worker.engine.model.model.layers]
    try:
        ids = [t for c in essay_chunks(essays, default_llm_path, 8) for t in c]
        warm = essay_chunks(essays, default_llm_path, 1)
        drive(worker, P.PrecomputeJob(chunks=warm, job_id=70))
        chunks = [ids[64:160], ids[160:250]]  # one piece (within the step's 256 tokens), one padded forward
        worker.sent.clear()
        ran.clear()  # the warm-up job's layers
        worker.receive(P.PrecomputeJob(chunks=chunks, job_id=71))
        worker.step()
        # in flight, its cache held: the padded forward beside the two chunks computed (ChunkCache.compute_peak)
        assert len(ran) == slice_ and worker.core.memory.extent_tokens == 2 * 96 + 96 + 90
        job = query(warm, [0], max_tokens=3)
        job.chunks = [P.ChunkRef(worker.kv.key_of(warm[0]), warm[0], 1.0)]
        job.job_id = 72
        worker.receive(job)
        while not any(isinstance(m, P.Delta) and m.job_id == 72 for m in worker.sent):
            worker.step()
        assert slice_ <= len(ran) <= 2 * slice_  # at most one more slice before the query's first token
        while worker.has_work:
            worker.step()
        done = next(m for m in worker.sent if isinstance(m, P.Done) and m.job_id == 71)
        assert len(ran) == layers and worker.core.memory.extent_tokens == 0
        unpaused = [worker.kv._at_rest(c.token_ids, [], c)[0] for c in worker.kv.compute(chunks, [[], []])]
        assert blobs(worker, done.keys) == unpaused

        worker.sent.clear()
        worker.receive(P.PrecomputeJob(chunks=[c[:-1] + [c[-1] ^ 1] for c in chunks], job_id=73))
        worker.step()
        assert worker.core.memory.extent_tokens > 0 and len(pause_threads()) == 1
        worker.receive(P.Cancel(73))
        assert worker.core.memory.extent_tokens == 0 and pause_threads() == [] and not worker.has_work
        assert not any(getattr(m, "job_id", None) == 73 for m in worker.sent if not isinstance(m, P.Step))
    finally:
        for h in hooks:
            h.remove()
