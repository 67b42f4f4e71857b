"""Shadow checks on the engine core (kvfuse/service/worker/shadow.py, the scheduler's preemptible class):
a check's verdict is the plain full prefill's, teacher forced (answer KL) and decoded greedily (agreement);
its KV is held in the core's memory; a query that needs that memory preempts it, and it is redone; a query
that arrives during a check is admitted at the next step and prefilled before it. A tiny random-weight
Llama keeps it fast; tests/service/worker/test_shadow_worker.py runs the same checks in a real worker."""

from __future__ import annotations

import pytest
import torch
from fusion_helpers import tiny_llama_engine

from kvfuse.answer_match import same_answer
from kvfuse.config import FidelitySettings
from kvfuse.fusion import ChunkKV, FusionEngine, FusionOptions, GenerationOptions
from kvfuse.fusion.engine import outputs as E
from kvfuse.fusion.engine import solo
from kvfuse.fusion.engine.core import EngineCore
from kvfuse.fusion.engine.requests import SchedulerLimits
from kvfuse.fusion.engine.sequence import Sequence
from kvfuse.fusion.teacher_forcing import answer_kl, teacher_forced_logits
from kvfuse.service.worker.shadow import ShadowCheck, ShadowChecks, ShadowSequence

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny(tokenizer) -> FusionEngine:
    return tiny_llama_engine(tokenizer)


def _prompt(engine: FusionEngine, i: int, context: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(200 + i)
    prefix_ids, question_ids = engine.prompt_parts(f"Question {i}?", "Answer.")
    half = context // 2
    chunks = [torch.randint(10, 5000, (n,), generator=g).tolist() for n in (half, context - half)]
    return [prefix_ids, *chunks, question_ids]


def _check(engine: FusionEngine, prompt: list[list[int]], alter: int | None = None) -> ShadowCheck:
    """A check of `pie`'s greedy answer over `prompt` (its steps' logits teacher forced through its own fused
    cache); `alter`: that answer's token at this index replaced, so the full prefill's argmax leaves it there."""
    prefix_ids, *chunk_ids, question = prompt
    prefix, *kvs = engine.precompute([prefix_ids, *chunk_ids])
    fusion = FusionOptions(method="pie", recompute_ratio=0.2)
    *_, fused_answer = solo.generate(engine, prefix, kvs, question, fusion,
                                     GenerationOptions(max_tokens=MAX_TOKENS, temperature=0.0))
    tokens = list(fused_answer.token_ids)
    if alter is not None:
        tokens[alter] = 4321 if tokens[alter] != 4321 else 4322
    fused = engine.fuse(prefix, kvs, question, fusion, max_tokens=len(tokens))
    steps = teacher_forced_logits(engine, fused, tokens).half()
    return ShadowCheck("pie", 0.2, prompt, tokens, engine.tokenizer.decode(tokens), steps, True, MAX_TOKENS, [])


def _reference(engine: FusionEngine, check: ShadowCheck) -> tuple[float, str]:
    """The old path's verdict, computed plainly: one whole full prefill, the answer teacher forced by one
    forward (answer KL), and the full prefill's greedy answer decoded whole."""
    prefix, *chunks, question = [ChunkKV(list(p)) for p in check.prompt]
    vanilla = FusionOptions(method="vanilla")
    full = engine.fuse(prefix, chunks, question.token_ids, vanilla, max_tokens=len(check.answer_tokens))
    kl = answer_kl(teacher_forced_logits(engine, full, check.answer_tokens), check.fused_steps.float())
    *_, greedy = solo.generate(engine, prefix, chunks, question.token_ids, vanilla,
                               GenerationOptions(max_tokens=check.max_tokens, temperature=0.0))
    return kl, greedy.text


def _core(engine: FusionEngine, budget: int, prefill: int = 512, running: int = 4) -> EngineCore:
    return EngineCore(engine, SchedulerLimits(max_running=running, kv_budget_tokens=budget,
                                              prefill_tokens_per_step=prefill, ingest_share=0.25))


def _shadow(core: EngineCore, engine: FusionEngine, check: ShadowCheck) -> ShadowSequence:
    seq = ShadowSequence(core.private_id(), check, engine, "text", lambda: core.step_no)
    core.add(seq, preemptible=True)
    return seq


def _drain(core: EngineCore) -> list:
    out: list = []
    while core.has_work:
        out.extend(core.step())
    return out


@pytest.mark.parametrize("alter", [None, 0, 3])
def test_a_check_on_the_core_gives_the_plain_full_prefills_kl_and_greedy_answer(tiny, alter) -> None:
    """None: pie's own answer; 0 / 3: its token there replaced, so the full prefill's greedy answer leaves
    the fused one there (at 3 after replaying three shared tokens from the forced rows)."""
    check = _check(tiny, _prompt(tiny, 0, 120), alter)
    kl, greedy_text = _reference(tiny, check)
    core = _core(tiny, 1024)
    seq = _shadow(core, tiny, check)
    out = _drain(core)
    assert [type(o) for o in out if not isinstance(o, E.Stepped | E.Token)] == [E.Admitted, E.Finished]
    v = seq.verdict
    assert v is not None and v.method == "pie" and v.answer_tokens == len(check.answer_tokens)
    assert v.context_tokens == check.context_tokens
    assert v.answer_kl == pytest.approx(kl, rel=1e-4, abs=1e-7)
    assert v.agreed == same_answer(check.answer_text, greedy_text, "text")
    if alter is not None:  # the greedy answer itself is the full prefill's
        assert v.agreed is False and seq.generation.text == greedy_text
    assert core.memory.used_tokens == 0  # its extent was released with it
    # its row is reported apart from the queries' rows, and its extent in the ledger as a shadow check's
    steps = [o for o in out if isinstance(o, E.Stepped)]
    assert all(s.running == 0 for s in steps) and steps[0].shadow == 1 and steps[-1].shadow == 0
    assert core.ledger.peak_holders["shadow"] == seq.kv_tokens * core.memory.token_bytes
    assert core.ledger.peak_holders["query"] == 0 and core.ledger.peak_bytes <= core.ledger.budget_bytes


def test_a_sampled_answer_gets_the_kl_alone(tiny) -> None:
    check = _check(tiny, _prompt(tiny, 1, 80))
    check.greedy = False
    kl, _ = _reference(tiny, check)
    core = _core(tiny, 1024)
    seq = _shadow(core, tiny, check)
    _drain(core)
    assert seq.verdict is not None and seq.verdict.agreed is None
    assert seq.verdict.answer_kl == pytest.approx(kl, rel=1e-4, abs=1e-7)


def _query(engine: FusionEngine, i: int, context: int, max_tokens: int = 4) -> Sequence:
    prefix_ids, *chunk_ids, question = _prompt(engine, 10 + i, context)
    prefix, *kvs = engine.precompute([prefix_ids, *chunk_ids])
    prompt = sum(len(c) for c in [prefix_ids, *chunk_ids, question])
    return Sequence(i, prefix_ids, question, FusionOptions(method="pie", recompute_ratio=0.2),
                    GenerationOptions(max_tokens=max_tokens, temperature=0.0), kv_tokens=prompt + max_tokens,
                    prefill_tokens=len(question), prefix=prefix, chunks=kvs)


def test_a_query_that_needs_the_checks_memory_preempts_it_and_the_check_is_redone(tiny) -> None:
    check = _check(tiny, _prompt(tiny, 2, 150), alter=2)
    want = _core(tiny, 1024)
    alone = _shadow(want, tiny, check)
    _drain(want)
    core = _core(tiny, 400)  # the check (~170 + 8) and the query (~260) cannot be held together
    seq = _shadow(core, tiny, check)
    out = core.step() + core.step()  # admitted, then its prefill
    assert core.scheduler.kv_used == seq.kv_tokens  # the check's KV is in the core's memory, counted
    query = _query(tiny, 1, 240)
    assert query.kv_tokens + seq.kv_tokens > 400
    core.add(query)
    first = core.step()
    assert [type(o) for o in first if isinstance(o, E.Preempted | E.Admitted)] == [E.Preempted, E.Admitted]
    assert first[0].job_id == seq.request_id and core.scheduler.preemptions == 1
    out += first + _drain(core)
    mine = [type(o) for o in out if getattr(o, "job_id", None) == seq.request_id and not isinstance(o, E.Token)]
    assert mine == [E.Admitted, E.Preempted, E.Admitted, E.Finished]  # redone after the query finished
    finished = [o.job_id for o in out if isinstance(o, E.Finished)]
    assert finished == [query.request_id, seq.request_id]
    assert seq.verdict is not None and alone.verdict is not None
    assert seq.verdict.answer_kl == pytest.approx(alone.verdict.answer_kl, rel=1e-6)
    assert seq.verdict.agreed == alone.verdict.agreed


def test_a_query_arriving_during_a_check_waits_at_most_one_step(tiny) -> None:
    """The check's prefill runs a layer at a time within what the step's queries leave of the prefill
    budget: a query arriving mid-check is admitted by the next step and prefilled first, and no step gives
    the check more than the budget plus one layer of its prompt's rows."""
    prefill = 16
    check = _check(tiny, _prompt(tiny, 3, 200))
    core = _core(tiny, 2048, prefill=prefill)
    seq = _shadow(core, tiny, check)
    core.step()
    core.step()
    assert seq.prefilling  # one layer per step: ~210 rows against a budget of 16 x 2
    query = _query(tiny, 2, 60)
    core.add(query)
    admitted = core.step()
    assert query.request_id in next(o for o in admitted if isinstance(o, E.Stepped)).admitted
    before = seq.max_step_work
    core.step()  # the query's prefill (its question rows) first, the check after it with what is left
    assert not query.prefilling and query.gen is not None
    out = _drain(core)
    assert seq.verdict is not None and any(isinstance(o, E.Finished) and o.job_id == 2 for o in out)
    budget = prefill * tiny.num_layers
    assert before <= budget + check.prompt_tokens and seq.max_step_work <= budget + check.prompt_tokens
    assert seq.verdict.slices == seq.steps >= tiny.num_layers


def test_checks_wait_while_a_query_waits_and_never_take_ingestions_share(tiny) -> None:
    core = _core(tiny, 2048)
    core.add(_query(tiny, 3, 40))
    _shadow(core, tiny, _check(tiny, _prompt(tiny, 4, 40)))
    done: list[object] = []
    core.add_ingest(99, lambda budget: done.append(budget) or (len(done) >= 2 or None))
    plan_steps = [core.step() for _ in range(2)]
    stepped = [next(o for o in s if isinstance(o, E.Stepped)) for s in plan_steps]
    assert stepped[0].admitted[0] == 3  # the query first; the check beside it, since none waits behind
    # With only the check running, ingestion runs every step, as on an idle worker.
    _drain(core)
    assert len(done) == 2


def test_shadow_checks_put_one_check_at_a_time_on_the_core(tiny) -> None:
    core = _core(tiny, 2048)
    checks = ShadowChecks(FidelitySettings(shadow_rate=1.0, metric="text"), tiny, core)
    for i in range(2):
        checks.queue.append(_check(tiny, _prompt(tiny, 5 + i, 40)))
    assert checks.submit(0) == [] and checks.running is not None and len(checks.queue) == 1
    verdicts = []
    while core.has_work:
        for o in core.step():
            if getattr(o, "job_id", None) is not None and checks.owns(o.job_id):
                verdicts += checks.on_output(o, core.step_no)
    assert len(verdicts) == 2 and checks.running is None and not checks.pending
    assert all(v.step > 0 and v.slices >= 1 for v in verdicts)
