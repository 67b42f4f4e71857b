"""The model runner (kvfuse/fusion/engine/runner.py): every decode step, pinned to the math.

- eager: sequences of different lengths and methods (an evicted cache among them) in one KV memory,
  decoded together, get each its own logits and greedy tokens as when decoded alone;
- static: the same step as a function of fixed-shape tensors (FlexAttention over the whole memory, a
  block mask per row, padding rows to a batch bucket) gives the eager step's logits, uncompiled on a tiny
  model here and compiled in a slow test, where the warm-up compiles every bucket and decoding compiles
  nothing more; on CUDA the captured graphs give the eager logits (skipped without a device).
"""

from __future__ import annotations

import pytest
import torch
from fusion_helpers import tiny_llama_engine

from kvfuse.fusion import FusionEngine, FusionError, FusionOptions
from kvfuse.fusion.engine.fused_cache import FusedCache
from kvfuse.fusion.engine.kv_memory import KVMemory
from kvfuse.fusion.engine.runner import BLOCK, ModelRunner, buckets

STEPS = 6
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _fused(engine, prompt, method, evict_capacity=0, new_cache=None):
    return engine.fuse(prompt.prefix, prompt.chunks, prompt.question_ids,
                       FusionOptions(method=method, recompute_ratio=0.3, evict_capacity=evict_capacity),
                       max_tokens=STEPS, new_cache=new_cache)


def _alone(engine, fused, steps=STEPS - 1) -> tuple[list[torch.Tensor], list[int]]:
    """Per-step logits and greedy tokens of one fused cache decoded by itself."""
    tokens, rows = [int(torch.argmax(fused.logits))], []
    for _ in range(steps):
        rows.append(engine.decode_step(fused.cache, tokens[-1]))
        tokens.append(int(torch.argmax(rows[-1])))
    return rows, tokens


def _in(memory: KVMemory, owner):
    """A `new_cache` that puts the prefill in `owner`'s new extent of `memory`."""
    def make(capacity: int) -> FusedCache:
        return FusedCache.in_memory(memory, memory.allocate(owner, capacity))
    return make


@pytest.mark.slow
@pytest.mark.parametrize("method", ["pie", "anchor", "vanilla"])
def test_a_batch_in_one_memory_gives_each_sequence_its_solo_logits(engine, prompts, method) -> None:
    cases = [(p, 0) for p in prompts] + [(prompts[0], 48)]  # the first once more, evicted to 48 tokens
    alone = [_alone(engine, _fused(engine, p, method, evict)) for p, evict in cases]
    memory = KVMemory.for_transformer(engine.tf, 2048)
    runner = ModelRunner(engine.tf, memory)
    fused = [_fused(engine, p, method, evict, new_cache=_in(memory, i)) for i, (p, evict) in enumerate(cases)]
    assert len({f.cache.length for f in fused}) == len(fused) and fused[-1].cache.position_offset > 0
    memory.shrink(len(cases) - 1, fused[-1].cache.capacity)  # eviction gave its tail back
    assert memory.used_tokens == sum(f.cache.capacity for f in fused)
    tokens = [[int(torch.argmax(f.logits))] for f in fused]
    for step in range(STEPS - 1):
        logits = runner.decode([f.cache for f in fused], torch.tensor([t[-1] for t in tokens]))
        assert logits.shape == (len(fused), engine.model.config.vocab_size) and logits.dtype == torch.float32
        for i, (rows, _) in enumerate(alone):
            torch.testing.assert_close(logits[i], rows[step], atol=1e-4, rtol=0)
            tokens[i].append(int(torch.argmax(logits[i])))
    assert tokens == [t for _, t in alone]


@pytest.mark.slow
def test_a_full_cache_is_refused_and_nothing_is_appended(engine, prompts) -> None:
    a, b = _fused(engine, prompts[0], "pie"), _fused(engine, prompts[1], "pie")
    b.cache.length = b.cache.capacity
    with pytest.raises(FusionError, match="sequence 1 is full"):
        engine.runner.decode([a.cache, b.cache], torch.tensor([1, 2]))
    assert a.cache.length == a.cache.capacity - STEPS


# -- the static path on a tiny model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tokenizer) -> FusionEngine:
    return tiny_llama_engine(tokenizer, max_positions=2048)


def _streams(engine, memory, lengths, gap=0, tag=""):
    """Caches of `lengths` random-token prefills in `memory`, a gap of `gap` tokens held between them."""
    g = torch.Generator().manual_seed(3)
    caches = []
    for i, n in enumerate(lengths):
        if gap:
            memory.allocate(("gap", tag, i), gap)
        ids = torch.randint(10, 1000, (n,), generator=g).tolist()
        caches.append(engine.fuse(None, [], ids, FusionOptions(method="vanilla"), max_tokens=STEPS,
                                  new_cache=_in(memory, (tag, i))).cache)
    return caches


def _decode_both(engine, lengths, gap, *, backend: str | None, max_batch: int) -> tuple[ModelRunner, list, list]:
    """The same streams decoded by the eager and the static runner, each over its own memory."""
    out = []
    for static in (False, True):
        memory = KVMemory(engine.num_layers, engine.num_kv_heads, engine.head_dim, 4 * BLOCK, engine.dtype,
                          "cpu", zeroed=static)
        runner = ModelRunner(engine.tf, memory, max_batch=max_batch, static=static, backend=backend)
        caches = _streams(engine, memory, lengths, gap)
        runner.warm_up()
        steps, tokens = [], torch.tensor([5 + i for i in range(len(caches))])
        for _ in range(STEPS - 1):
            steps.append(runner.decode(caches, tokens))
            tokens = steps[-1].argmax(-1)
        out.append((runner, steps))
    (_, eager), (runner, static) = out
    return runner, eager, static


def test_the_static_step_gives_the_eager_steps_logits(tiny) -> None:
    """Uncompiled (FlexAttention's reference implementation): three streams, one crossing a key block's
    boundary and one a whole block long, between gaps held by others, padded to a bucket of four rows."""
    runner, eager, static = _decode_both(tiny, [5, BLOCK - 2, 40], gap=30, backend=None, max_batch=4)
    assert runner.static and set(runner._steps) == {1, 2, 4}  # warmed: every bucket up to max_batch
    for want, got in zip(eager, static, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_the_static_step_traces_whole_and_compiles_only_in_the_warm_up(tiny) -> None:
    """torch.compile(fullgraph=True) traces the whole step or fails: nothing in it depends on a Python
    number. Traced by dynamo and run by "aot_eager" (the graph inductor would compile, run as traced;
    on CUDA inductor compiles it), every bucket is traced in the warm-up and decoding traces nothing more."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    runner, eager, static = _decode_both(tiny, [7, 60], gap=20, backend="aot_eager", max_batch=2)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == len(buckets(2)) and runner.warmup_s > 0
    for want, got in zip(eager, static, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # more steps of other lengths and batch sizes compile nothing more
    memory = runner.memory
    more = _streams(tiny, memory, [3], gap=0, tag="more")
    runner.decode(more, torch.tensor([9]))
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_give_the_eager_steps_logits(default_llm_path, prompts) -> None:
    """On CUDA the static step replays a graph per batch bucket, captured in the warm-up: the eager step's
    logits, through a capture, replays and a smaller batch (another bucket)."""
    gpu = FusionEngine.load(default_llm_path, device="cuda", dtype="float32")
    results = []
    for static in (False, True):
        memory = KVMemory.for_transformer(gpu.tf, 8 * BLOCK, zeroed=static)
        runner = ModelRunner(gpu.tf, memory, max_batch=4, static=static, cuda_graphs=True)
        runner.warm_up()
        fused = [_fused(gpu, p, "anchor", new_cache=_in(memory, i)) for i, p in enumerate(prompts)]
        caches, tokens, steps = [f.cache for f in fused], torch.tensor([5, 7, 9], device="cuda"), []
        for step in range(STEPS - 1):
            if step == 2:
                caches, tokens = caches[:2], tokens[:2]
            steps.append(runner.decode(caches, tokens))
            tokens = steps[-1].argmax(-1)
        results.append((runner, steps))
    (_, want), (runner, got) = results
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
    assert runner.use_graphs and all(s.graph is not None for s in runner._steps.values())
