"""The worker's plan of a labelled query (kvfuse/service/worker/sequences.py): the chunks' names come with
the job, and the question part numbers the chunks that fit, from 1, in prompt order; a plain job (no
names) keeps the plain question part. Real default model; no scheduler loop needed."""

from __future__ import annotations

import pytest

from kvfuse.fusion.engine.core import EngineCore
from kvfuse.fusion.engine.requests import SchedulerLimits
from kvfuse.service.wire import protocol as P
from kvfuse.service.worker.sequences import plan_query


@pytest.fixture(scope="module")
def engine(default_llm_path: str):
    from kvfuse.fusion import FusionEngine

    return FusionEngine.load(default_llm_path, dtype="float32")


def _plan(engine, chunks: list[P.ChunkRef], limit: int):
    # cold_chunks "compute": the plan looks up no tier (auto asks the store which chunks are cold)
    job = P.QueryJob("Where?", None, False, {"method": "anchor", "cold_chunks": "compute"}, {"max_tokens": 4}, chunks, 1)
    core = EngineCore(engine, SchedulerLimits(max_running=4, kv_budget_tokens=100_000, prefill_tokens_per_step=2048,
                                              ingest_share=0.25))
    seq = plan_query(job, engine, core, limit, 0, kv=None)  # planning reads no KV
    assert not isinstance(seq, P.Error), seq
    return seq


def test_a_labelled_query_numbers_the_chunks_that_fit(engine) -> None:
    tok = engine.tokenize
    chunks = [P.ChunkRef("a", tok("Alpha text. ") * 20, 0.9, "alpha"), P.ChunkRef("b", tok("Beta."), 0.1, "beta"),
              P.ChunkRef("c", tok("Gamma."), 0.5, "gamma")]
    seq = _plan(engine, chunks, 4096)
    assert seq.kept == [0, 1, 2]
    assert engine.tokenizer.decode(seq.question_ids).startswith(
        "Documents, in order: [1] alpha; [2] beta; [3] gamma.\n\nQuestion: Where?")
    # a context that cannot hold every chunk: the lowest-scored goes, the others are numbered 1 and 2
    fixed = len(seq.prefix_ids) + len(seq.question_ids) + 4
    seq = _plan(engine, chunks, fixed + len(chunks[0].token_ids) + len(chunks[2].token_ids))
    assert seq.kept == [0, 2] and seq.dropped == [1]
    assert "[1] alpha; [2] gamma." in engine.tokenizer.decode(seq.question_ids)
    # no names: the plain prompt, as before the layouts existed
    plain = _plan(engine, [P.ChunkRef(c.key, c.token_ids, c.score) for c in chunks], 4096)
    assert plain.question_ids == engine.prompt_parts("Where?", None)[1]
