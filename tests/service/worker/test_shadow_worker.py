"""Shadow checks in the worker (worker/shadow.py) through its supervisor: a real worker process, the real
default model. What a live request waits behind shadow work is asserted on the messages' engine steps
and the checks' own accounting of their work per engine step, never on wall time."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from test_scheduler_worker import MODEL_CACHE, Harness, Outcome, essay_chunks, query

from kvfuse.config import load_settings
from kvfuse.service.wire import protocol as P

pytestmark = pytest.mark.slow

PREFILL_TOKENS = 32  # the engine's prefill budget per step (x layers), so one check's prefill spans many


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    root = tmp_path_factory.mktemp("shadow-worker")
    settings = load_settings(data_dir=root / "data", model_cache_dir=MODEL_CACHE, log_level="warning",
                             model={"max_context_tokens": 4096, "threads": 1},
                             server={"prefill_tokens_per_step": PREFILL_TOKENS},
                             fidelity={"shadow_rate": 1.0, "shadow_queue": 2})
    h = Harness(settings)
    h.verdicts = []
    h.sup.shadow_sink = h.verdicts.append  # called on the harness's loop
    try:
        yield h
    finally:
        h.close()


@pytest.fixture(scope="module")
def chunks(essays, default_llm_path: str) -> list[list[int]]:
    return essay_chunks(essays, default_llm_path, 12)


def until_verdicts(h: Harness, n: int) -> list:
    async def go():
        while len(h.verdicts) < n:
            await asyncio.sleep(0.05)
        return list(h.verdicts)
    return h.call(go())


def test_a_live_request_waits_at_most_one_step_of_shadow_work(harness: Harness, chunks) -> None:
    big = query(chunks, list(range(8)), max_tokens=6)  # ~540 prompt tokens: a check over many engine steps
    small = query(chunks, [9], method="vanilla", max_tokens=4)  # never shadowed (it is the full prefill)
    before = len(harness.verdicts)

    async def go():
        first = await harness.collect(harness.sup.submit(big))
        # The check of `big` goes on the engine core when it finishes; `small` arrives while it runs.
        second = await harness.collect(harness.sup.submit(small))
        return first, second

    first, second = harness.call(go())
    assert isinstance(first, Outcome) and isinstance(second, Outcome)
    (verdict,) = until_verdicts(harness, before + 1)[before:]
    layers = harness.sup.info["num_layers"]
    prompt = sum(first.result.usage[k] for k in ("prefix_tokens", "context_tokens", "question_tokens"))
    budget = PREFILL_TOKENS * layers
    assert verdict.method == "anchor" and verdict.answer_tokens >= 1 and verdict.answer_kl >= 0
    # The bound: the check's prefill takes the step's prefill budget (rows x layers) that queries leave,
    # overshooting it by under one layer of its prompt's rows, and a decode row per step after it: about
    # one engine step, far below its whole prefill's prompt x layers.
    assert verdict.slices >= prompt * layers // (budget + prompt)
    assert verdict.max_slice_work < budget + prompt + layers < prompt * layers // 8
    # `small` did not wait for the whole check: it was admitted, ran and finished before the check ended.
    assert second.plan.step < second.result.step <= verdict.step
    assert verdict.step > first.result.step


def test_pending_checks_are_bounded_oldest_dropped(harness: Harness, chunks) -> None:
    before = len(harness.verdicts)
    jobs = [query(chunks, [i, i + 1], max_tokens=3) for i in range(5)]
    outs = harness.run_all(jobs)  # five finish together: the queue of two keeps the newest
    assert all(isinstance(o, Outcome) for o in outs)
    got = until_verdicts(harness, before + 5)[before:]
    dropped = [v for v in got if isinstance(v, P.ShadowDropped)]
    checked = [v for v in got if isinstance(v, P.ShadowResult)]
    assert len(dropped) + len(checked) == 5 and len(dropped) >= 1
    assert all(v.method == "anchor" for v in got)


def test_pending_checks_are_bounded_in_memory_too(tmp_path, chunks) -> None:
    """A budget below one answer token's distribution (a vocabulary row of fp16) keeps no check: each is
    dropped on arrival and counted, and the worker goes on answering."""
    settings = load_settings(data_dir=tmp_path / "data", model_cache_dir=MODEL_CACHE, log_level="warning",
                             model={"max_context_tokens": 4096, "threads": 1},
                             fidelity={"shadow_rate": 1.0, "shadow_memory_mb": 0.01})
    h = Harness(settings)
    h.verdicts = []
    h.sup.shadow_sink = h.verdicts.append
    try:
        outs = h.run_all([query(chunks, [i], max_tokens=2) for i in range(2)])
        assert all(isinstance(o, Outcome) for o in outs)
        got = until_verdicts(h, 2)
        assert [type(v) for v in got] == [P.ShadowDropped, P.ShadowDropped]
    finally:
        h.close()


def test_a_fused_answer_that_is_the_full_prefill_checks_as_agreeing_with_no_kl(harness: Harness, chunks) -> None:
    """anchor at ratio 1 recomputes every row: its answer is the full prefill's, token for token, so the
    check agrees (replaying every row, no decode step) and its answer KL is rounding only."""
    before = len(harness.verdicts)
    job = query(chunks, [2, 3, 4], max_tokens=10)
    job.fusion["recompute_ratio"] = 1.0
    (out,) = harness.run_all([job])
    assert isinstance(out, Outcome)
    (verdict,) = until_verdicts(harness, before + 1)[before:]
    assert verdict.agreed is True and verdict.recompute_ratio == 1.0
    assert verdict.answer_tokens == out.result.usage["generated_tokens"] + (out.result.finish_reason == "stop")
    assert verdict.answer_kl < 1e-4


def test_n_choices_get_one_check_of_choice_0(harness: Harness, chunks) -> None:
    """A query of n = 3 is fused once and checked at most once: one verdict, of choice 0's answer."""
    job = query(chunks, [0, 1], max_tokens=5)
    job.n = 3
    before = len(harness.verdicts)
    done = harness.call(harness.collect(harness.sup.submit(job)))
    assert isinstance(done, Outcome) and [c["index"] for c in done.result.choices] == [1, 2]
    (verdict,) = until_verdicts(harness, before + 1)[before:]
    assert verdict.method == "anchor"
    assert verdict.answer_tokens <= done.result.usage["generated_tokens"] // 3 + 1  # one choice's answer
    harness.call(asyncio.sleep(2.0))  # the worker is idle: no further check of the same query arrives
    assert len(harness.verdicts) == before + 1
