"""The batching worker through its supervisor: a real worker process with the real default model and a
real LMDB store, driven by typed jobs. Every message names the engine step it came from, so batching,
cancellation and ingestion's share are asserted on step numbers, never on wall time.

Chunk keys here are not in the store: the worker rebuilds each chunk's KV from its token ids, as it
does for a missing blob. One worker serves the module, on an event loop in a thread of its own."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvfuse.config import load_settings
from kvfuse.service.dispatch.job_book import QueueFull, WorkerCrashed, WorkerJobError
from kvfuse.service.dispatch.supervisor import WorkerSupervisor
from kvfuse.service.metrics import Metrics
from kvfuse.service.wire import protocol as P

pytestmark = pytest.mark.slow

MODEL_CACHE = Path(os.environ.get("KVFUSE_TEST_MODEL_CACHE", Path(__file__).resolve().parents[3] / "data" / "models"))
KV_BUDGET = 2400
TIMEOUT_S = 240
LONG_SYSTEM = "You write very long, detailed answers that go on for many paragraphs."
LONG_QUESTION = "Describe everything in the documents in full detail, at great length, one point at a time."


@dataclass
class Outcome:
    plan: P.Plan | None
    deltas: list[P.Delta]
    result: P.Result
    status: P.JobStatus  # the API-side job's, once its result was read

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)


class Harness:
    """A supervisor on its own event loop; `call` runs a coroutine there and waits."""

    def __init__(self, settings) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.sup = WorkerSupervisor(settings, Metrics())
        self.call(self.sup.start())
        assert self.call(self.sup.wait_ready(TIMEOUT_S)), self.sup.last_error

    def call(self, coro, timeout: float = TIMEOUT_S):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, job):
        async def go():
            return self.sup.submit(job)
        return self.call(go())

    def cancel(self, job) -> None:
        async def go():
            self.sup.cancel(job)
        self.call(go())

    async def collect(self, job, on_delta=None) -> Outcome:
        plan, deltas = None, []
        async for msg in self.sup.events(job):
            if isinstance(msg, P.Plan):
                plan = msg
            elif isinstance(msg, P.Delta):
                deltas.append(msg)
                if on_delta is not None:
                    on_delta(job, len(deltas))
            elif isinstance(msg, P.Result):
                return Outcome(plan, deltas, msg, job.status)
        raise AssertionError("no result")

    def run_all(self, jobs: list, on_delta=None) -> list:
        async def go():
            handles = [self.sup.submit(j) for j in jobs]
            return await asyncio.gather(*(self.collect(h, on_delta) for h in handles), return_exceptions=True)
        return self.call(go())

    def close(self) -> None:
        self.call(self.sup.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    root = tmp_path_factory.mktemp("sched-worker")
    settings = load_settings(data_dir=root / "data", model_cache_dir=MODEL_CACHE, log_level="warning",
                             model={"max_context_tokens": 4096, "threads": 1},
                             server={"max_running_requests": 4, "kv_budget_tokens": KV_BUDGET, "queue_size": 4,
                                     "prefill_tokens_per_step": 256, "ingest_step_share": 0.25})
    h = Harness(settings)
    try:
        yield h
    finally:
        h.close()


def essay_chunks(essays, default_llm_path: str, count: int) -> list[list[int]]:
    """The first `count` 64-token chunks of the "apple" essay, as token ids of the default model."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_llm_path)
    ids = tok(dict(essays)["apple"], add_special_tokens=False)["input_ids"]
    return [ids[i : i + 64] for i in range(0, 64 * count, 64)]


@pytest.fixture(scope="module")
def chunks(essays, default_llm_path: str) -> list[list[int]]:
    return essay_chunks(essays, default_llm_path, 40)


def query(chunks: list[list[int]], picks: list[int], *, method: str = "anchor", max_tokens: int = 8,
          question: str = "What does the author think of the App Store?", system_prompt: str | None = None,
          **gen) -> P.QueryJob:
    refs = [P.ChunkRef(f"missing-{i}", chunks[i], 1.0) for i in picks]
    # every chunk is in no tier: computed within the query (the fused path these tests are about), never
    # answered by a full prefill instead (fusion.cold_chunks auto: tests/service/worker/test_first_use.py)
    fusion = {"method": method, "recompute_ratio": 0.15, "cold_chunks": "compute"}
    return P.QueryJob(question=question, system_prompt=system_prompt, explicit=True, fusion=fusion,
                      generation={"max_tokens": max_tokens, "temperature": 0.0, "top_p": 1.0, "seed": None,
                                  "stop": [], **gen}, chunks=refs)


def four(chunks: list[list[int]]) -> list[P.QueryJob]:
    """Different contexts, lengths, methods, stop strings; one sampled with a seed."""
    return [query(chunks, [0, 1, 2], max_tokens=10),
            query(chunks, [5], method="vanilla", max_tokens=6, question="Who wrote this?"),
            query(chunks, [3, 4], method="a3", max_tokens=12, stop=["."]),
            query(chunks, [6, 7], method="pie", max_tokens=9, temperature=0.9, top_p=0.95, seed=11)]


def test_a_batch_of_four_gives_each_the_tokens_it_gets_alone(harness: Harness, chunks) -> None:
    alone = [harness.run_all([j])[0] for j in four(chunks)]
    assert all(isinstance(a, Outcome) for a in alone), alone
    first_step = harness.sup.steps[-1].step + 1
    together = harness.run_all(four(chunks))
    for a, b in zip(alone, together, strict=True):
        assert not isinstance(b, BaseException), b
        assert (b.result.text, b.result.finish_reason, b.result.usage) == (a.result.text, a.result.finish_reason,
                                                                           a.result.usage)
        assert b.text == b.result.text
    steps = [s for s in harness.sup.steps if s.step >= first_step]
    assert max(s.batch_size for s in steps) == 4  # all four decoded in the same steps
    assert together[2].result.finish_reason == "stop" or "." not in together[2].result.text


def test_cancelled_request_is_gone_within_a_step_and_the_others_are_unchanged(harness: Harness, chunks) -> None:
    jobs = four(chunks)
    for j in jobs:
        j.generation["max_tokens"] = 40
        j.generation["stop"] = []
    alone = [harness.run_all([j])[0] for j in [jobs[0], jobs[1], jobs[3]]]
    seen_at: dict[int, int] = {}

    def on_delta(job, n: int) -> None:
        if job.message is target and n == 2:
            seen_at[job.id] = harness.sup.steps[-1].step
            harness.sup.cancel(job)  # on the loop already

    target = jobs[2]
    out = harness.run_all(jobs, on_delta)
    cancelled = out[2]
    assert cancelled.result.finish_reason == "cancelled" and cancelled.status is P.JobStatus.CANCELLED
    assert [o.status for o in (out[0], out[1], out[3])] == [P.JobStatus.FINISHED] * 3
    (job_id, step_seen), = seen_at.items()
    # The API had seen step `step_seen`; the Cancel reaches the worker during the next step at the latest
    # (give it one more for the pipe) and takes effect at the top of the following one.
    assert cancelled.result.step <= step_seen + 3
    assert max(d.step for d in cancelled.deltas) <= cancelled.result.step
    for a, b in zip(alone, [out[0], out[1], out[3]], strict=True):
        assert (b.result.text, b.result.finish_reason) == (a.result.text, a.result.finish_reason)


def test_small_kv_budget_makes_the_fourth_wait_then_complete_and_a_full_queue_refuses(harness: Harness,
                                                                                       chunks) -> None:
    # Each holds prompt (~240) + 420 tokens: three fit the budget of 2400, the fourth waits for one to end.
    jobs = [query(chunks, [i, i + 1, i + 2], max_tokens=420, method="pie") for i in (0, 3, 6, 9)]

    async def go():
        handles = [harness.sup.submit(j) for j in jobs]
        while harness.sup.running < 3:
            await asyncio.sleep(0.02)
        extra = [harness.sup.submit(query(chunks, [12], max_tokens=4)) for _ in range(3)]  # queue: 1 + 3 = 4
        with pytest.raises(QueueFull):
            harness.sup.submit(query(chunks, [13], max_tokens=4))
        outs = await asyncio.gather(*(harness.collect(h) for h in handles + extra))
        return outs

    outs = harness.call(go())
    assert all(o.result.finish_reason in ("stop", "length") and o.result.text for o in outs)  # none lost
    ends = sorted(o.result.step for o in outs[:3])
    assert outs[3].plan.step >= ends[0]  # admitted only once a running one had retired
    assert all(s.kv_tokens <= KV_BUDGET for s in harness.sup.steps)
    # Alone larger than the budget (but within the model context): refused at once, never queued.
    (err,) = harness.run_all([query(chunks, list(range(10)), max_tokens=2000)])
    assert isinstance(err, WorkerJobError) and err.kind == P.ERR_KV_BUDGET, err


def test_a_prompt_past_the_context_is_refused_at_planning(harness: Harness, chunks) -> None:
    # The API refuses such a prompt before retrieval (kvfuse/service/rag/prompt_size.py); the worker, whose
    # context is the one that counts (a fleet's workers may differ), still checks exactly, in the same words.
    (err,) = harness.run_all([query(chunks, [0], max_tokens=4096)])
    assert isinstance(err, WorkerJobError) and err.kind == P.ERR_MAX_TOKENS, err
    assert "plus max_tokens (4096) exceed the model context of 4096 tokens by" in err.message
    assert err.excess_tokens > 0


def test_kvlink_link_slots_count_against_the_kv_budget(harness: Harness, chunks) -> None:
    # 36 chunks of 64 tokens and the prompt fit the budget of 2400 alone; with kvlink's 5 link slots
    # after each chunk (180 rows more) they do not: refused at planning, with what the links add.
    job = query(chunks, list(range(36)), method="kvlink", max_tokens=1)
    job.fusion["link_tokens"] = 5
    (err,) = harness.run_all([job])
    assert isinstance(err, WorkerJobError) and err.kind == P.ERR_KV_BUDGET, err
    assert 0 < err.excess_tokens <= 36 * 5  # without the links it would have fit


def test_ingest_shares_the_steps_with_streaming_queries(harness: Harness, chunks) -> None:
    start = harness.sup.steps[-1].step + 1 if harness.sup.steps else 0
    pre = P.PrecomputeJob(chunks=[c[:-1] + [c[-1] ^ 1] for c in chunks[:24]])  # new chunks: all computed

    async def go():
        qs = [harness.sup.submit(query(chunks, [i], method="pie", max_tokens=24)) for i in (20, 21)]
        ingest = harness.sup.submit(pre)
        outs = await asyncio.gather(*(harness.collect(q) for q in qs))
        done = None
        async for msg in harness.sup.events(ingest):
            done = msg
        return outs, done

    outs, done = harness.call(go())
    assert isinstance(done, P.Done) and done.computed == 24
    steps = [s for s in harness.sup.steps if s.step >= start]
    busy = [s for s in steps if s.batch_size > 0]
    assert all(s.batch_size >= s.running for s in busy)  # every running query decoded in every step
    # Every busy step decoded the running queries; ingestion had some of them, not all (its share is one of
    # time: pinned in tests/fusion/test_engine_scheduler.py). Its six pieces (four 64-token chunks each,
    # within the step's 256 tokens: one forward each) ran server.ingest_layers_per_step layers per step.
    ingest_busy = [s.step for s in busy if s.ingest_job is not None]
    assert 1 <= len(ingest_busy) < len(busy)
    layers, per_step = harness.sup.info["num_layers"], harness.sup.settings.server.ingest_layers_per_step
    slices = 6 * -(-layers // per_step)  # the step of the last slice may report after the job's Done is read
    assert slices - 1 <= sum(s.ingest_job is not None for s in steps) <= slices
    assert all(o.result.text for o in outs)


def test_worker_killed_with_four_running_ends_each_cleanly_and_restarts(harness: Harness, chunks) -> None:
    jobs = [query(chunks, [i], method="pie", max_tokens=400, system_prompt=LONG_SYSTEM, question=LONG_QUESTION)
            for i in range(4)]
    waiting = query(chunks, [4], max_tokens=4)
    crashed: list = []

    async def go():
        handles = [harness.sup.submit(j) for j in jobs]
        while harness.sup.running < 4:
            await asyncio.sleep(0.05)
        assert all(h.status is P.JobStatus.RUNNING for h in handles)
        crashed.extend(handles)
        late = harness.sup.submit(waiting)  # waits in the worker: it was never started
        assert late.status is P.JobStatus.WAITING
        os.kill(harness.sup.pid, signal.SIGKILL)
        outs = await asyncio.gather(*(harness.collect(h) for h in handles), return_exceptions=True)
        return outs, await harness.collect(late)

    restarts = harness.sup.restarts
    outs, late = harness.call(go())
    assert all(isinstance(o, WorkerCrashed) for o in outs), outs
    assert all(j.status is P.JobStatus.FAILED for j in crashed)
    assert harness.sup.restarts == restarts + 1
    assert late.result.finish_reason in ("stop", "length") and late.result.text  # re-sent to the new worker
    nxt = harness.run_all([query(chunks, [5], max_tokens=4)])[0]
    assert nxt.result.text


def test_a_long_prefill_is_spread_over_steps_while_the_running_stream_decodes(harness: Harness, chunks) -> None:
    streaming = query(chunks, [30], method="pie", max_tokens=40)
    long = query(chunks, list(range(12)), method="vanilla", max_tokens=4)  # ~830 prompt rows, 256 per step
    alone = [harness.run_all([j])[0] for j in (streaming, long)]
    together = harness.run_all([streaming, long])
    for a, b in zip(alone, together, strict=True):
        assert not isinstance(b, BaseException), b
        assert (b.result.text, b.result.usage) == (a.result.text, a.result.usage)
    s_out, l_out = together
    first = l_out.deltas[0].step
    assert first - l_out.plan.step >= 3  # the prefill took several steps...
    by_step = {s.step: s for s in harness.sup.steps}
    between = [by_step[i] for i in range(l_out.plan.step, first)]
    assert all(s.batch_size == 1 for s in between)  # ...in each of which the running stream decoded
    assert s_out.result.step > first  # (it was still running throughout)
