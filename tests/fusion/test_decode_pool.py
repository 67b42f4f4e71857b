"""The worker's decode path: fused caches placed into the KV pool and decoded by one batched step per
token (kvfuse/fusion/kv_pool.py, model_runner.py). Pinned to the per-cache step (each sequence over its
own fused cache, alone): the same logits and greedy tokens for sequences of different lengths and
methods (an evicted cache among them), slots freed and reused, and the step traceable as one graph."""

from __future__ import annotations

import pytest
import torch

from kvfuse.fusion import FusionError, FusionOptions
from kvfuse.fusion.kv_pool import KVPool
from kvfuse.fusion.model_runner import DecodeRunner

pytestmark = pytest.mark.slow

STEPS = 6


def _fused(engine, prompt, method, evict_capacity=0):
    return engine.fuse(prompt.prefix, prompt.chunks, prompt.question_ids,
                       FusionOptions(method=method, recompute_ratio=0.3, evict_capacity=evict_capacity),
                       max_tokens=STEPS)


def _alone(engine, fused, steps=STEPS - 1) -> tuple[list[torch.Tensor], list[int]]:
    """Per-step logits and greedy tokens of one fused cache decoded by itself (the per-cache step)."""
    tokens, rows = [int(torch.argmax(fused.logits))], []
    for _ in range(steps):
        rows.append(engine.decode_step(fused.cache, tokens[-1]))
        tokens.append(int(torch.argmax(rows[-1])))
    return rows, tokens


def _runner(engine, **kwargs) -> DecodeRunner:
    return DecodeRunner(engine.tf, KVPool.for_transformer(engine.tf), **kwargs)


def _cases(engine, prompts, method):
    """Three prompts fused by `method`, and the first once more evicted to 48 tokens after its prefill."""
    return [lambda p=p: _fused(engine, p, method) for p in prompts] + [lambda: _fused(engine, prompts[0], method, 48)]


@pytest.mark.parametrize("method", ["pie", "anchor", "vanilla"])
def test_pooled_step_gives_each_sequence_its_own_logits(engine, prompts, method) -> None:
    cases = _cases(engine, prompts, method)
    alone = [_alone(engine, make()) for make in cases]
    runner = _runner(engine)
    fused = [make() for make in cases]
    assert len({f.cache.length for f in fused}) == len(fused) and fused[-1].cache.position_offset > 0
    for i, f in enumerate(fused):
        assert runner.pool.admit(f"seq{i}", f.cache) == i
    tokens = [[int(torch.argmax(f.logits))] for f in fused]
    for step in range(STEPS - 1):
        logits = runner.step(torch.tensor([t[-1] for t in tokens]))
        assert logits.shape == (len(fused), engine.model.config.vocab_size) and logits.dtype == torch.float32
        for i, (rows, _) in enumerate(alone):
            torch.testing.assert_close(logits[i], rows[step], atol=1e-4, rtol=0)
            tokens[i].append(int(torch.argmax(logits[i])))
    assert tokens == [t for _, t in alone]
    assert runner.pool.lengths == [f.cache.length + STEPS - 1 for f in fused]
    # positions past a slot's length are masked, never uninitialised: 0 x NaN would poison the row
    assert torch.isfinite(runner.pool.k).all() and torch.isfinite(runner.pool.v).all()


def test_a_released_slot_moves_the_last_in_and_is_reused(engine, prompts) -> None:
    """A sequence ending (finished or cancelled) frees its slot at once: the last slot's sequence moves
    into the hole and decodes on unchanged; a newcomer takes the next slot; an empty pool frees its memory."""
    runner = _runner(engine)
    pool = runner.pool
    refs = [_alone(engine, _fused(engine, p, "anchor")) for p in prompts]
    fused = [_fused(engine, p, "anchor") for p in prompts]
    for i, f in enumerate(fused):
        pool.admit(i, f.cache)
    tokens = [[int(torch.argmax(f.logits))] for f in fused]

    def step(owners: list[int]) -> None:
        """One pooled step; each owner's row against its own decode step alone."""
        logits = runner.step(torch.tensor([tokens[o][-1] for o in owners]))
        for row, o in enumerate(owners):
            torch.testing.assert_close(logits[row], refs[o][0][len(tokens[o]) - 1], atol=1e-4, rtol=0)
            tokens[o].append(int(torch.argmax(logits[row])))

    step([0, 1, 2])
    pool.release(0)  # the first ends: sequence 2 moves into slot 0
    assert pool.owners == [2, 1] and pool.slot_of(2) == 0
    with pytest.raises(KeyError):
        pool.slot_of(0)
    step([2, 1])
    late = _fused(engine, prompts[0], "anchor")  # a newcomer takes the freed capacity
    assert pool.admit(3, late.cache) == 2
    tokens.append([int(torch.argmax(late.logits))])
    refs.append(refs[0])
    step([2, 1, 3])
    pool.release(1)
    step([2, 3])
    assert tokens[2] == refs[2][1][:5] and tokens[3] == refs[0][1][:3]
    pool.release(2)
    pool.release(3)
    pool.release(3)  # releasing twice is a no-op
    assert pool.size == 0 and pool.nbytes == 0


def test_a_full_slot_is_refused_and_nothing_is_appended(engine, prompts) -> None:
    runner = _runner(engine)
    a, b = _fused(engine, prompts[0], "pie"), _fused(engine, prompts[1], "pie")
    runner.pool.admit("a", a.cache)
    runner.pool.admit("b", b.cache)
    runner.pool.lengths[1] = runner.pool.limits[1]
    with pytest.raises(FusionError, match="'b' is full"):
        runner.step(torch.tensor([1, 2]))
    assert runner.pool.lengths[0] == a.cache.length


def test_the_step_compiles_as_one_graph(engine, prompts) -> None:
    """torch.compile(fullgraph=True) traces the whole step or fails: nothing in it depends on a Python
    number (batch and window come from the static input shapes). The compiled step gives the eager
    step's logits, and a second step of the same shapes reuses the graph. The "eager" backend runs the
    graph dynamo traced as it is: the fullgraph check is dynamo's, and inductor's code generation takes
    minutes on this machine (docs/results/decode/README.md)."""
    from torch._dynamo.utils import counters

    eager, compiled = _runner(engine), _runner(engine, compile_backend="eager")
    for runner in (eager, compiled):
        for i, p in enumerate(prompts[:2]):
            runner.pool.admit(i, _fused(engine, p, "anchor").cache)
    torch._dynamo.reset()
    counters.clear()
    tokens = torch.tensor([5, 7])
    for _ in range(2):
        want, got = eager.step(tokens), compiled.step(tokens)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        tokens = want.argmax(-1)
    assert counters["stats"]["unique_graphs"] == 1
    assert eager.pool.lengths == compiled.pool.lengths


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_give_the_eager_steps_logits(default_llm_path, prompts) -> None:
    """On CUDA the step replays graphs captured per (batch bucket, window bucket): the eager step's
    logits, through a capture, replays, a slot released (a smaller bucket) and a pool regrown (graphs
    of the old buffers dropped)."""
    from kvfuse.fusion import FusionEngine

    gpu = FusionEngine.load(default_llm_path, device="cuda", dtype="float32")
    eager, graphs = _runner(gpu), _runner(gpu, cuda_graphs=True)
    for runner in (eager, graphs):
        for i, p in enumerate(prompts):
            runner.pool.admit(i, _fused(gpu, p, "anchor").cache)
    tokens = torch.tensor([5, 7, 9], device="cuda")
    for step in range(STEPS - 1):
        if step == 2:
            for runner in (eager, graphs):
                runner.pool.release(1)
            tokens = tokens[[0, 2]]
        want, got = eager.step(tokens), graphs.step(tokens)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        tokens = want.argmax(-1)
    assert graphs._graphs and graphs.use_graphs  # captured, and no capture fell back to eager
