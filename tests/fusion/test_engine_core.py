"""The engine core (kvfuse/fusion/engine/core.py) in-process, with no transport: a batch of requests gives
each its solo tokens, the KV memory holds whatever the mix of lengths, a failing sequence fails alone,
and an abort ends a request wherever it is. A tiny random-weight Llama keeps it fast; the service tests
run the same core with the real model behind the worker's transports."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fusion_helpers import tiny_llama_engine

from kvfuse.fusion import FusionEngine, FusionOptions, GenerationOptions
from kvfuse.fusion.engine import outputs as E
from kvfuse.fusion.engine import solo
from kvfuse.fusion.engine.core import EngineCore
from kvfuse.fusion.engine.requests import SchedulerLimits
from kvfuse.fusion.engine.runner import ModelRunner
from kvfuse.fusion.engine.sequence import Sequence
from kvfuse.fusion.errors import NonFiniteLogits

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tiny(tokenizer) -> FusionEngine:
    return tiny_llama_engine(tokenizer)


def _request(engine, i: int, context: int, method: str = "pie"):
    """Request i: a system prefix, one chunk of `context` seeded tokens (its KV precomputed) and a question."""
    g = torch.Generator().manual_seed(100 + i)
    chunk = torch.randint(10, 5000, (context,), generator=g).tolist()
    prefix_ids, question_ids = engine.prompt_parts(f"Question {i}?", "Answer.")
    prefix, kv = engine.precompute([prefix_ids, chunk])
    return prefix, [kv], question_ids, FusionOptions(method=method, recompute_ratio=0.2)


def _solo(engine, req) -> list[int]:
    prefix, chunks, question_ids, fusion = req
    *_, result = solo.generate(engine, prefix, chunks, question_ids, fusion,
                                 GenerationOptions(max_tokens=MAX_TOKENS, temperature=0.0))
    return result.token_ids


def _sequence(engine, i, req) -> Sequence:
    prefix, chunks, question_ids, fusion = req
    kv_tokens = len(prefix) + sum(len(c) for c in chunks) + len(question_ids) + MAX_TOKENS
    return Sequence(i, prefix.token_ids, question_ids, fusion, GenerationOptions(max_tokens=MAX_TOKENS, temperature=0.0),
                    kv_tokens=kv_tokens, prefill_tokens=len(question_ids), prefix=prefix, chunks=chunks)


def _core(engine, budget: int, running: int = 8) -> EngineCore:
    return EngineCore(engine, SchedulerLimits(max_running=running, kv_budget_tokens=budget,
                                              prefill_tokens_per_step=512, ingest_share=0.25))


def _run(core: EngineCore, seqs: list[Sequence], each_step=None) -> list:
    out: list = []
    for s in seqs:
        core.add(s)
    while core.has_work:
        if each_step is not None:
            each_step(core, out)
        out.extend(core.step())
    return out


def _tokens(out: list, job) -> list[int] | None:
    done = [o for o in out if isinstance(o, E.Finished) and o.job_id == job]
    return done[0].seq.gen.token_ids if done else None


def test_a_batch_gives_each_request_its_solo_tokens(tiny) -> None:
    reqs = [_request(tiny, i, n, m) for i, (n, m) in enumerate([(40, "pie"), (150, "anchor"), (7, "vanilla")])]
    solo = [_solo(tiny, r) for r in reqs]
    out = _run(_core(tiny, 1024), [_sequence(tiny, i, r) for i, r in enumerate(reqs)])
    assert [_tokens(out, i) for i in range(3)] == solo
    steps = [o for o in out if isinstance(o, E.Stepped)]
    assert max(s.batch for s in steps) == 3  # they decoded together
    kinds = [type(o).__name__ for o in out if getattr(o, "job_id", None) == 1]
    assert kinds[0] == "Admitted" and kinds[-1] == "Finished" and "Token" in kinds


def test_a_step_returns_the_admission_before_the_prefill_runs(tiny) -> None:
    """The step that admits a request returns its Admitted output and runs none of its prefill (the
    service sends the plan before a long prefill starts); the next step completes the prefill and returns
    its first token, then decodes it with the batch in that same step: the solo answer's first two."""
    req = _request(tiny, 0, 60)
    core = _core(tiny, 1024)
    seq = _sequence(tiny, 0, req)
    core.add(seq)
    first = core.step()
    assert [type(o).__name__ for o in first] == ["Admitted", "Stepped"] and seq.prefilling and seq.gen is None
    second = core.step()
    assert seq.gen is not None and seq.gen.token_ids == _solo(tiny, req)[:2] and isinstance(second[-1], E.Stepped)
    assert not any(isinstance(o, E.Admitted) for o in second)


def test_kv_memory_holds_one_long_request_beside_many_short(tiny) -> None:
    """One long request and eight short ones in a memory that cannot hold them all: the bytes held never
    pass the budget, the buffers are never replaced, each row decodes over its own extent, and every
    request ends with its solo tokens."""
    reqs = [_request(tiny, 0, 900)] + [_request(tiny, i, 30) for i in range(1, 9)]
    seqs = [_sequence(tiny, i, r) for i, r in enumerate(reqs)]
    budget = seqs[0].kv_tokens + 3 * seqs[1].kv_tokens
    core = _core(tiny, budget)
    buffers = (core.memory.k.data_ptr(), core.memory.v.data_ptr())
    held = []

    def check(core: EngineCore, out) -> None:
        mem = core.memory
        held.append(mem.used_bytes)
        assert mem.used_bytes <= mem.nbytes == budget * mem.token_bytes
        assert (mem.k.data_ptr(), mem.v.data_ptr()) == buffers
        for r in core.scheduler.decode_batch():
            assert r.seq.cache.extent is r.extent and r.seq.cache.capacity <= r.extent.tokens

    out = _run(core, seqs, check)
    assert [_tokens(out, i) for i in range(9)] == [_solo(tiny, r) for r in reqs]
    assert max(held) > seqs[0].kv_tokens  # the long one ran beside short ones
    assert max(s.running for s in out if isinstance(s, E.Stepped)) < 9  # not all at once: some waited


def _decoding(core: EngineCore, out: list, n: int) -> None:
    while len(core.scheduler.decode_batch()) < n:
        out.extend(core.step())


def test_a_sequence_with_broken_kv_fails_alone(tiny) -> None:
    """NaN in one sequence's extent: that sequence fails with a clear error; its neighbours in the batch
    keep decoding their solo tokens."""
    reqs = [_request(tiny, i, 20 + 10 * i) for i in range(3)]
    core, out = _core(tiny, 1024), []
    for i, r in enumerate(reqs):
        core.add(_sequence(tiny, i, r))
    _decoding(core, out, 3)
    broken = core.scheduler.running[1].extent
    core.memory.k[:, :, broken.start : broken.start + 5] = float("nan")
    while core.has_work:
        out.extend(core.step())
    failed = [o for o in out if isinstance(o, E.Failed)]
    assert [f.job_id for f in failed] == [1] and "non-finite logits" in str(failed[0].error)
    assert _tokens(out, 0) == _solo(tiny, reqs[0]) and _tokens(out, 2) == _solo(tiny, reqs[2])
    assert core.memory.used_tokens == 0


def _with_nan(req, token: int = 3):
    """The request with NaN in its chunk's V at `token` (every layer and head)."""
    prefix, chunks, question_ids, fusion = req
    broken = chunks[0].v.clone()
    broken[:, :, token] = float("nan")
    return prefix, [dataclasses.replace(chunks[0], v=broken)], question_ids, fusion


def test_a_sequence_whose_prefill_logits_are_not_finite_fails_alone(tiny) -> None:
    """NaN in one request's chunk KV makes its prefill logits NaN: it fails at its prefill, before any
    token, with the error a decode row gets; the other request of the batch gives its solo tokens."""
    good, bad = _request(tiny, 0, 30), _with_nan(_request(tiny, 1, 40))
    seqs = [_sequence(tiny, 0, good), _sequence(tiny, 1, bad)]
    seen: list[bool] = []
    seqs[1].on_logits = lambda row: seen.append(bool(torch.isfinite(row).all()))
    out = _run(_core(tiny, 1024), seqs)
    failed = [o for o in out if isinstance(o, E.Failed)]
    assert [f.job_id for f in failed] == [1] and isinstance(failed[0].error, NonFiniteLogits)
    assert "non-finite logits" in str(failed[0].error)
    assert seen == [] and seqs[1].gen is None  # failed at its prefill: no token was taken from NaN
    assert not any(isinstance(o, E.Token) and o.job_id == 1 for o in out)
    assert _tokens(out, 0) == _solo(tiny, good)


def test_a_batched_step_that_raises_is_retried_row_by_row(tiny) -> None:
    """A token id outside the vocabulary makes the batched forward raise: the step is retried one
    sequence at a time, only that sequence fails, the others keep their solo tokens."""
    reqs = [_request(tiny, i, 25) for i in range(3)]
    core, out = _core(tiny, 1024), []
    for i, r in enumerate(reqs):
        core.add(_sequence(tiny, i, r))
    _decoding(core, out, 3)
    core.scheduler.running[2].seq.gen.last_token = tiny.model.config.vocab_size + 7
    while core.has_work:
        out.extend(core.step())
    failed = [o for o in out if isinstance(o, E.Failed)]
    assert [f.job_id for f in failed] == [2] and isinstance(failed[0].error, IndexError)
    assert _tokens(out, 0) == _solo(tiny, reqs[0]) and _tokens(out, 1) == _solo(tiny, reqs[1])


def test_abort_ends_a_request_wherever_it_is(tiny) -> None:
    reqs = [_request(tiny, i, 30) for i in range(3)]
    seqs = [_sequence(tiny, i, r) for i, r in enumerate(reqs)]
    core, out = _core(tiny, seqs[0].kv_tokens + seqs[1].kv_tokens, running=2), []
    for s in seqs:
        core.add(s)
    _decoding(core, out, 2)
    out.extend(core.abort(0))  # decoding: finishes as cancelled
    out.extend(core.abort(2))  # still waiting: fails as cancelled
    assert core.abort(2) == []  # already gone: nothing
    ends = [o for o in out if isinstance(o, E.Finished | E.Failed)]
    assert [(type(o).__name__, o.job_id) for o in ends] == [("Finished", 0), ("Failed", 2)]
    assert ends[0].seq.gen.finished == "cancelled" and isinstance(ends[1].error, E.Cancelled)
    assert core.memory.extent_of(0) is None and core.scheduler.num_waiting == 0
    while core.has_work:
        out.extend(core.step())
    assert _tokens(out, 1) == _solo(tiny, reqs[1])


def test_a_request_that_can_never_fit_is_refused(tiny) -> None:
    core = _core(tiny, 64)
    seq = _sequence(tiny, 0, _request(tiny, 0, 100))
    assert not core.fits(seq.kv_tokens)
    with pytest.raises(ValueError, match="over the budget"):
        core.add(seq)


def test_generate_is_a_batch_of_one_on_the_core_with_its_non_finite_check(tiny) -> None:
    """`solo.generate` decodes on an engine core: a chunk whose KV holds NaN makes its logits
    non-finite, and the core's check fails the request with a clear error instead of yielding tokens."""
    prefix, chunks, question_ids, fusion = _with_nan(_request(tiny, 0, 30, "pie"))
    with pytest.raises(NonFiniteLogits, match="non-finite logits"):
        list(solo.generate(tiny, prefix, chunks, question_ids, fusion, GenerationOptions(max_tokens=MAX_TOKENS)))


def test_forced_tokens_decode_through_a_core_as_the_runner_steps_them(tiny) -> None:
    """Teacher forcing on a core (solo.forced_logits): the fed tokens are taken whatever the logits
    choose, an EOS among them does not end it, and each row is the logits the runner's own step gives
    after the same tokens over the same prefill (the path the load check and teacher forcing took)."""
    prefix, chunks, question_ids, fusion = _request(tiny, 0, 40)
    eos = next(iter(tiny.stop_token_ids))
    feed = [5, eos, 77, 300, 12]
    fused, ref = (tiny.fuse(prefix, chunks, question_ids, fusion, max_tokens=len(feed) + 1) for _ in range(2))
    runner = ModelRunner(tiny.tf)
    want = torch.stack([ref.logits.float(), *(runner.decode([ref.cache], torch.tensor([t]))[0] for t in feed)])
    assert [int(t) for t in want[:-1].argmax(-1)] != feed  # not the model's own choices
    got = solo.forced_logits(tiny, fused, feed)
    assert got.shape == (len(feed) + 1, tiny.model.config.vocab_size) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert fused.cache.length == ref.cache.length  # every fed token went into the cache


def test_a_forced_sequence_refuses_penalties(tiny) -> None:
    prefix, chunks, question_ids, fusion = _request(tiny, 0, 10)
    with pytest.raises(ValueError, match="penalties"):
        Sequence(0, prefix.token_ids, question_ids, fusion, GenerationOptions(max_tokens=3, presence_penalty=1.0),
                 kv_tokens=64, prefill_tokens=8, prefix=prefix, chunks=chunks, forced=[1, 2])


def test_an_ingestion_piece_holds_its_forwards_cache_in_the_kv_memory(tiny) -> None:
    """An ingestion piece's forward (the model's own cache of a padded batch) is reserved in the memory
    while it runs: beside a running query it holds the query's extent plus its own; with no room for it
    the piece waits for the first step that has it; one that could never fit fails its job alone."""
    seq = _sequence(tiny, 0, _request(tiny, 0, 60))
    core = _core(tiny, seq.kv_tokens + 200)
    core.add(seq)
    seen: list[int] = []

    def piece(budget: int) -> object | None:
        seen.append(core.memory.used_tokens)
        return "done" if len(seen) == 2 else None

    core.add_ingest(7, piece, need=lambda budget: 150)
    while core.has_work and not seen:
        core.step()
    assert seen == [seq.kv_tokens + 150]  # the query's extent and the piece's, within the budget
    assert core.memory.used_tokens == seq.kv_tokens  # given back when the piece returned
    core.add_ingest(8, lambda budget: "never", need=lambda budget: 201)  # no room beside the query
    out = _run(core, [])
    assert len(seen) == 2 and [o.value for o in out if isinstance(o, E.Ingested)] == ["done", "never"]
    assert core.ingest_kv_peak <= core.memory.capacity
    core.add_ingest(9, lambda budget: "never", need=lambda budget: core.memory.capacity + 1)
    (failed,) = [o for o in _run(core, []) if isinstance(o, E.Failed)]
    assert failed.job_id == 9 and "KV tokens" in str(failed.error) and core.memory.used_tokens == 0


def test_a_carve_is_set_aside_from_the_budget_before_the_buffer_is_allocated(tiny) -> None:
    """The device tier's cap comes out of the one budget: the buffer is the rest, in whole tokens, and a
    budget the carves leave nothing of is refused at start, naming them."""
    from kvfuse.fusion.engine.kv_memory import token_bytes_of
    from kvfuse.fusion.engine.ledger import Carve

    per = token_bytes_of(tiny.tf)
    held = {"bytes": 0}
    tier = Carve("device_tier", 100 * per + 1, lambda: held["bytes"])
    limits = SchedulerLimits(max_running=2, kv_budget_tokens=1000, prefill_tokens_per_step=64, ingest_share=0.25)
    core = EngineCore(tiny, limits, carves=(tier,))
    assert core.memory.capacity == 1000 - 101 and core.scheduler.capacity == 899
    assert core.ledger.budget_bytes == 1000 * per and core.memory.token_bytes == per
    held["bytes"] = 90 * per
    assert core.ledger.report().holders["device_tier"] == 90 * per
    with pytest.raises(ValueError, match="leaves no KV memory beside the 1001 tokens carved for device_tier"):
        EngineCore(tiny, dataclasses.replace(limits, kv_budget_tokens=1001), carves=(Carve("device_tier", 1001 * per, int),))


def test_a_piece_in_flight_keeps_its_memory_between_turns_and_cancel_gives_it_back(tiny) -> None:
    """A piece paused between decoder layers (IN_FLIGHT) is resumed on the job's next turn with the memory
    of its forward still held (its need asked once per piece); cancelled in flight, its `stop` runs and the
    memory is free at once."""
    from kvfuse.fusion.engine.requests import IN_FLIGHT

    core = _core(tiny, 400)
    turns: list[int] = []
    asked: list[int] = []

    def piece(budget: int) -> object | None:
        turns.append(core.memory.used_tokens)
        return "done" if len(turns) == 3 else IN_FLIGHT

    core.add_ingest(5, piece, need=lambda budget: asked.append(budget) or 120)
    out = _run(core, [])
    assert turns == [120, 120, 120] and len(asked) == 1 and core.memory.used_tokens == 0
    assert [o.value for o in out if isinstance(o, E.Ingested)] == ["done"]
    stopped: list[bool] = []
    core.add_ingest(6, lambda budget: IN_FLIGHT, need=lambda budget: 80, stop=lambda: stopped.append(True))
    core.step()
    core.step()
    assert core.memory.used_tokens == 80 and core.has_work and not stopped
    assert core.abort(6) == [] and stopped == [True] and core.memory.used_tokens == 0 and not core.has_work
