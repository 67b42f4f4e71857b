"""bf16 and fp16, as a GPU worker runs: every selective method at r = 1 against the full prefill, the
layer-by-layer KV loader against plain placement, a batch against each request alone.

The CPU half runs everywhere; the CUDA half (`-m cuda`) wherever a GPU is present.

Tolerance, and why: in a 16-bit dtype two computations that are equal in exact arithmetic differ by
rounding, and how much depends on the order of the operations. The reference is the same model in fp32
(its weights are the 16-bit ones, widened), and a method at r = 1 must be no further from it than the
full prefill in the same 16-bit dtype is, times 1.5 (a slack for the other operation order), plus a
floor of one unit in the last place of the largest logit.
"""

from __future__ import annotations

import pytest
import torch
from fusion_helpers import make_prompt
from test_fusion_architectures import build, chunks_of

from kvfuse.fusion import ChunkKV, FusionEngine, FusionOptions, GenerationOptions
from kvfuse.fusion.engine import solo
from kvfuse.fusion.engine.fused_cache import FusedCache
from kvfuse.fusion.kv_loading import LayerLoader

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda,
                                              pytest.mark.skipif(not CUDA, reason="no CUDA device")])]
DTYPES = ["bfloat16", "float16"]
SELECTIVE = ["anchor", "a3", "cacheblend", "prophetkv", "epic"]
FULL = dict(recompute_ratio=1.0, edge_tokens=1000, edge_tokens_end=1000)


def tiny_engine(kind: str, tokenizer, device: str, dtype: str) -> FusionEngine:
    model = build(kind, len(tokenizer)).to(device=device, dtype=getattr(torch, dtype))
    return FusionEngine(model, tokenizer, dtype=dtype)


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> float:
    return float(x.abs().max()) * torch.finfo(dtype).eps


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["llama3-rope", "mistral", "qwen2"])
def test_selective_methods_at_full_ratio_are_as_close_as_the_full_prefill(tokenizer, kind, dtype, device):
    eng = tiny_engine(kind, tokenizer, device, dtype)
    prefix_ids, *chunk_ids, question_ids = chunks_of(eng, [5, 40, 33, 47, 9])
    ids = prefix_ids + sum(chunk_ids, []) + question_ids
    with torch.inference_mode():
        wide = eng.model.float()
        truth = wide(torch.tensor([ids], device=device), logits_to_keep=1).logits[0, -1]
        eng.model.to(getattr(torch, dtype))
    kvs = eng.precompute([prefix_ids, *chunk_ids])
    vanilla = eng.fuse(kvs[0], [ChunkKV(c) for c in chunk_ids], question_ids, FusionOptions(method="vanilla"))
    budget = 1.5 * float((vanilla.logits - truth).abs().max()) + _ulp(truth, eng.dtype)
    for method in SELECTIVE:
        fused = eng.fuse(kvs[0], kvs[1:], question_ids, FusionOptions(method=method, **FULL))
        err = float((fused.logits - truth).abs().max())
        assert err <= budget, f"{method}: {err:.3g} from fp32, the full prefill's budget {budget:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_answers_at_full_ratio_equal_vanilla_in_bf16(default_llm_path, essays, device):
    """The default model in bf16: every selective method at r = 1 writes vanilla's greedy tokens."""
    eng = FusionEngine.load(default_llm_path, dtype="bfloat16", device=device)
    texts = dict(essays)
    prompts = [make_prompt(eng, texts["apple"], "What does the author think of the App Store?", [64, 48, 56]),
               make_prompt(eng, list(texts.values())[7], "What is the main point?", [90, 20, 41, 12])]
    gen = GenerationOptions(max_tokens=8)
    eng.stop_token_ids = set()
    for p in prompts:
        tokens = {}
        for method in ["vanilla", *SELECTIVE]:
            *_, result = solo.generate(eng, p.prefix, p.chunks, p.question_ids, FusionOptions(method=method, **FULL), gen)
            tokens[method] = result.token_ids
        assert all(t == tokens["vanilla"] for t in tokens.values()), tokens


# A batch's rows go through matrix products of another shape than a row alone, and in bf16 the products'
# blocking changes the rounding: the same token's logits may differ by a few units in the last place
# (0.125 for a logit in [16, 32)), compounded over the layers. Not bit for bit, then: within this
# budget, and the same greedy token wherever the request alone is not that close to a tie.
BATCH_LOGIT_BUDGET = 1.0


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_in_bf16_decodes_as_each_request_alone(default_llm_path, essays, device):
    eng = FusionEngine.load(default_llm_path, dtype="bfloat16", device=device)
    texts = list(dict(essays).values())
    prompts = [make_prompt(eng, texts[i], q, sizes) for i, q, sizes in
               [(0, "What is this about?", [64, 48]), (3, "Who is the essay about?", [30]),
                (7, "What is the main point?", [90, 20, 41])]]
    opts = FusionOptions(method="anchor", recompute_ratio=0.3)
    steps = 6

    def fused(p):
        return eng.fuse(p.prefix, p.chunks, p.question_ids, opts, max_tokens=steps)

    alone = []  # per request: the logits of each step, decoding its own greedy tokens
    for p in prompts:
        f = fused(p)
        rows = [f.logits]
        for _ in range(steps - 1):
            rows.append(eng.decode_batch([f.cache], rows[-1].argmax().view(1))[0])
        alone.append(torch.stack(rows))
    batch = [fused(p) for p in prompts]
    rows = [torch.stack([f.logits for f in batch])]
    for step in range(steps - 1):  # fed each request's own tokens, so a tie cannot send it elsewhere
        rows.append(eng.decode_batch([f.cache for f in batch], torch.stack([a[step].argmax() for a in alone])))
    together = torch.stack(rows, dim=1)
    for own, joint in zip(alone, together, strict=True):
        assert float((own - joint).abs().max()) <= BATCH_LOGIT_BUDGET
        top2 = own.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * BATCH_LOGIT_BUDGET
        assert torch.equal(own.argmax(-1)[clear], joint.argmax(-1)[clear])


def _reference_placement(eng: FusionEngine, chunks: list[ChunkKV], starts: list[int], dtype: torch.dtype):
    """What the loader must produce: each chunk's keys rotated in fp32 to its start, rounded once."""
    k = torch.cat([c.k for c in chunks], dim=2).to(eng.device)
    v = torch.cat([c.v for c in chunks], dim=2).to(eng.device)
    deltas = torch.cat([torch.full((len(c),), s) for c, s in zip(chunks, starts, strict=True)])
    cos, sin = eng.rope.shift_table(deltas)
    k32 = k.float()
    from kvfuse.fusion.model.rope import rotate_half

    return (k32 * cos + rotate_half(k32) * sin).to(dtype), v.to(dtype)


def _load(eng, chunks, starts, total, dtype) -> FusedCache:
    cache = FusedCache(eng.num_layers, eng.num_kv_heads, eng.head_dim, total, dtype, eng.device)
    cache.loader = LayerLoader(cache, eng.rope, chunks, starts, True).start()
    cache.finish_loading()
    return cache


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stored", ["bfloat16", "float16", "float32"])
def test_layer_loader_places_what_plain_placement_would(tokenizer, device, stored):
    """From every place a chunk's KV can live (pageable or page-locked host memory, the device), each
    layer lands bit for bit where the reference placement puts it, in the compute dtype."""
    eng = tiny_engine("llama3-rope", tokenizer, device, "bfloat16")
    chunk_ids = chunks_of(eng, [7, 40, 33, 47])
    kvs = [ChunkKV(c.token_ids, c.k.to(getattr(torch, stored)), c.v.to(getattr(torch, stored)))
           for c in eng.precompute(chunk_ids)]
    prefix, chunks = kvs[0], kvs[1:]
    starts = [len(prefix)]
    for c in chunks[:-1]:
        starts.append(starts[-1] + len(c))
    total = starts[-1] + len(chunks[-1])
    ref_k, ref_v = _reference_placement(eng, [ChunkKV(c.token_ids, c.k.cpu(), c.v.cpu()) for c in chunks],
                                        starts, eng.dtype)
    sources = {"pageable": [ChunkKV(c.token_ids, c.k.cpu(), c.v.cpu()) for c in chunks]}
    if device == "cuda":
        sources["pinned"] = [ChunkKV(c.token_ids, c.k.cpu().pin_memory(), c.v.cpu().pin_memory()) for c in chunks]
        sources["device"] = [ChunkKV(c.token_ids, c.k.cuda(), c.v.cuda()) for c in chunks]
    for name, src in sources.items():
        cache = _load(eng, src, starts, total, eng.dtype)
        assert torch.equal(cache.k[:, :, starts[0]:total], ref_k), name
        assert torch.equal(cache.v[:, :, starts[0]:total], ref_v), name


@pytest.mark.parametrize("device", DEVICES)
def test_fused_prefill_with_the_loader_equals_a_cache_placed_up_front(tokenizer, device):
    """The prefill that reads layers as they arrive gives the logits of the one that had them all first."""
    eng = tiny_engine("qwen2", tokenizer, device, "bfloat16")
    prefix_ids, *chunk_ids, question_ids = chunks_of(eng, [5, 40, 33, 47, 9])
    kvs = eng.precompute([prefix_ids, *chunk_ids])
    chunks = [ChunkKV(c.token_ids, c.k.cpu(), c.v.cpu()) for c in kvs[1:]]
    opts = FusionOptions(method="anchor", recompute_ratio=0.3)
    streamed = eng.fuse(kvs[0], chunks, question_ids, opts)
    original = LayerLoader.wait

    def all_at_once(self, layer):  # the first access waits for every layer
        for i in range(self.num_layers):
            original(self, i)

    LayerLoader.wait = all_at_once
    try:
        upfront = eng.fuse(kvs[0], chunks, question_ids, opts)
    finally:
        LayerLoader.wait = original
    assert torch.equal(streamed.selected, upfront.selected)
    assert torch.equal(streamed.logits, upfront.logits)
