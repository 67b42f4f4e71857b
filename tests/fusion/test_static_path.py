"""The static decode path, as CUDA runs it by default less the graph capture (kvfuse/fusion/engine/runner.py,
static_support.py), through torch.compile on the CPU, pinned to the eager path:

- per family with a window or a soft-cap (tiny random-weight models, tests/tiny_models.py), the step
  traced whole by dynamo and run as traced ("aot_eager"): one row gives the eager step's logits, and a
  batch gives each row its solo tokens and logits;
- compiled by inductor: a row with NaN in its K or V fails alone, on both paths, and once it retires its
  extent is cleared, so the row beside it still decodes as it would alone (FlexAttention reads whole
  128-key blocks and a masked score still multiplies its value: the memory is zeroed and block-aligned
  on this path);
- compiled by inductor, as serving compiles it, on a family without and one with soft-caps and windows:
  one row gives the eager step's logits and a batch each row its solo logits.

Compiles are shared through one inductor cache (the `inductor_cache` fixture), so only a first run pays
for them; two batch buckets per model keep them few.
"""

from __future__ import annotations

import re

import pytest
import tiny_models
import torch

from kvfuse.fusion import FusionEngine, FusionOptions
from kvfuse.fusion.engine import static_support
from kvfuse.fusion.engine.fused_cache import FusedCache
from kvfuse.fusion.engine.kv_memory import KVMemory
from kvfuse.fusion.engine.runner import BLOCK, ModelRunner

CAPACITY = 4 * BLOCK
STEPS = 4
LENGTHS = (61, BLOCK - 2)  # both past every tiny model's window; the second crosses a key block


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test traces its runners afresh: earlier tests in the same process (test_engine_runner.py,
    test_attention_paths.py) trace the same step's code with other models and buckets, and dynamo's
    recompile limit counts every trace of a code object in the process. The inductor cache on disk keeps
    the recompiles cheap."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# family -> what the test must exercise on it
FAMILIES = {"llama": "tied embeddings, llama3 rope", "mistral": "a window on every layer",
            "gemma2": "soft-caps, alternating windows"}
compiled = pytest.mark.slow


def _engine(family: str, tokenizer) -> FusionEngine:
    return FusionEngine(tiny_models.build(family, len(tokenizer)), tokenizer, dtype="float32")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_engine(request, tokenizer, inductor_cache) -> tuple[str, FusionEngine]:
    return request.param, _engine(request.param, tokenizer)


def _runner(engine: FusionEngine, static: bool, backend: str = "inductor") -> ModelRunner:
    memory = KVMemory.for_transformer(engine.tf, CAPACITY, zeroed=static, align=BLOCK if static else 1)
    runner = ModelRunner(engine.tf, memory, max_batch=2, static=static, backend=backend if static else None)
    runner.warm_up()
    return runner


def _prompt_ids(n: int, seed: int) -> list[int]:
    return torch.randint(10, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _cache(engine: FusionEngine, runner: ModelRunner, owner, n: int, seed: int) -> FusedCache:
    memory = runner.memory

    def new_cache(capacity: int) -> FusedCache:
        return FusedCache.in_memory(memory, memory.allocate(owner, capacity), capacity)

    return engine.fuse(None, [], _prompt_ids(n, seed), FusionOptions(method="vanilla"), max_tokens=STEPS + 4,
                       new_cache=new_cache).cache


def _decode(runner: ModelRunner, caches: list[FusedCache], steps: int = STEPS, first: int = 5) -> list[torch.Tensor]:
    """Per step, the batch's logits [B, vocab], each row fed its own greedy token."""
    out, tokens = [], torch.tensor([first + i for i in range(len(caches))])
    for _ in range(steps):
        out.append(runner.decode(caches, tokens))
        tokens = torch.nan_to_num(out[-1]).argmax(-1)
    return out


@compiled
def test_the_traced_static_step_gives_eager_logits_and_each_row_its_solo_tokens(family_engine) -> None:
    """Traced whole by dynamo and run as traced ("aot_eager": the graph inductor compiles)."""
    family, engine = family_engine
    tf = engine.tf
    windows = {w for w in (getattr(tf, "windows", None) or []) if w}
    if family != "llama":  # the feature under test is on: windows shorter than the prompts, soft-caps
        assert windows and max(windows) < LENGTHS[0], FAMILIES[family]
    assert bool(getattr(tf, "softcap", None)) == (family == "gemma2")
    results = {}
    for static in (False, True):
        runner = _runner(engine, static, "aot_eager")
        batch = _decode(runner, [_cache(engine, runner, i, n, seed=i) for i, n in enumerate(LENGTHS)])
        solos = []
        for i, n in enumerate(LENGTHS):  # each row alone (a bucket of one on the static path)
            runner = _runner(engine, static, "aot_eager")
            solos.append(_decode(runner, [_cache(engine, runner, "solo", n, seed=i)], first=5 + i))
        results[static] = batch, solos
    (eager_batch, eager_solos), (static_batch, static_solos) = results[False], results[True]
    for i in range(len(LENGTHS)):
        # r = 1: the static step of one row is the eager step's, step by step
        for want, got in zip(eager_solos[i], static_solos[i], strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        # a batch: each row its solo logits and greedy tokens
        for solo, rows in zip(static_solos[i], static_batch, strict=True):
            torch.testing.assert_close(rows[i : i + 1], solo, atol=1e-4, rtol=0)
            assert int(rows[i].argmax()) == int(solo[0].argmax())
    for want, got in zip(eager_batch, static_batch, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@compiled
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_inductor_on_the_cpu_gives_the_eager_steps_logits_and_each_row_its_solo_ones(tokenizer, inductor_cache,
                                                                                     family: str) -> None:
    """Compiled by inductor as serving compiles it (its C++ FlexAttention kernel here, Triton on CUDA): one
    row gives the eager step's logits, and a batch of two gives each row its solo logits. It failed
    while the layers' K/V were views taken inside the compiled step (every layer read layer 0's keys:
    runner.py, ModelRunner.layers_k)."""
    engine = _tiny_llama(tokenizer) if family == "llama" else _engine(family, tokenizer)
    solos: dict[bool, list[list[torch.Tensor]]] = {}
    for static in (False, True):
        solos[static] = []
        for i, n in enumerate(LENGTHS):
            runner = _runner(engine, static)
            solos[static].append(_decode(runner, [_cache(engine, runner, "solo", n, seed=i)], first=5 + i))
    for want_steps, got_steps in zip(solos[False], solos[True], strict=True):
        for want, got in zip(want_steps, got_steps, strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    runner = _runner(engine, True)
    batch = _decode(runner, [_cache(engine, runner, i, n, seed=i) for i, n in enumerate(LENGTHS)])
    for i in range(len(LENGTHS)):
        for rows, solo in zip(batch, solos[True][i], strict=True):
            torch.testing.assert_close(rows[i : i + 1], solo, atol=1e-4, rtol=0)


@compiled
@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("tensor", ["k", "v"])
def test_a_row_with_nan_fails_alone_and_its_released_extent_is_cleared(tokenizer, inductor_cache, static: bool,
                                                                       tensor: str) -> None:
    engine = _tiny_llama(tokenizer)
    clean_runner = _runner(engine, static)
    clean = _decode(clean_runner, [_cache(engine, clean_runner, "a", LENGTHS[0], seed=0)], steps=STEPS + 2)
    runner = _runner(engine, static)
    a = _cache(engine, runner, "a", LENGTHS[0], seed=0)
    b = _cache(engine, runner, "b", LENGTHS[1], seed=1)
    getattr(b, tensor)[:, :, 7] = float("nan")  # one token of row 1, every layer
    steps = _decode(runner, [a, b])
    for want, got in zip(clean, steps, strict=False):
        if tensor == "v" or not static:
            assert not got[1].isfinite().all()  # the poisoned row fails
        # (a NaN key on the static path: inductor's CPU kernel keeps the row's scores finite, so whether
        # that row fails is the kernel's; what is pinned here is that no other row can tell)
        torch.testing.assert_close(got[:1], want, atol=1e-4, rtol=0)  # its neighbour is untouched
    extent = runner.memory.extent_of("b")
    runner.memory.release("b")  # row 1 retires: on the static path nothing it held stays behind
    if static:
        assert not runner.memory.k[:, :, extent.start : extent.stop].any()
        assert not runner.memory.v[:, :, extent.start : extent.stop].any()
    tokens = torch.tensor([int(steps[-1][0].argmax())])
    for want in clean[STEPS:]:
        got = runner.decode([a], tokens)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        tokens = got.argmax(-1)


_TINY: dict[int, FusionEngine] = {}


def _tiny_llama(tokenizer) -> FusionEngine:
    """One tiny Llama for the NaN tests (one compile of its buckets, whichever test runs first)."""
    if id(tokenizer) not in _TINY:
        _TINY[id(tokenizer)] = _engine("llama", tokenizer)
    return _TINY[id(tokenizer)]


def test_the_static_path_refuses_a_torch_without_what_it_calls(tokenizer, monkeypatch) -> None:
    """This torch has it all; a torch without BlockMask.from_kv_blocks (a fake: the attribute removed, as an
    older torch lacks it) is refused before any compile, the message naming what is missing and the way
    round it. Graph capture is named as the only CUDA-only part."""
    from torch.nn.attention import flex_attention

    assert static_support.missing() == []
    assert any("CUDAGraph" in part for part in static_support.CUDA_ONLY)
    monkeypatch.delattr(flex_attention.BlockMask, "from_kv_blocks")
    assert static_support.missing() == ["BlockMask.from_kv_blocks"]
    engine = _tiny_llama(tokenizer)
    memory = KVMemory.for_transformer(engine.tf, CAPACITY, zeroed=True, align=BLOCK)
    with pytest.raises(static_support.StaticPathUnavailable,
                       match=rf"from_kv_blocks, which torch {re.escape(torch.__version__)} lacks.*decode_cuda_graphs=false"):
        ModelRunner(engine.tf, memory, max_batch=2, static=True)
    assert not ModelRunner(engine.tf, memory, max_batch=2, static=False).static  # eager needs none of it
