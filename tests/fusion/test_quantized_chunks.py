"""Chunks stored in a quantized KV format reach the fused cache through `ChunkKV.layer_kv`, a layer at a
time (kvfuse/fusion/kv_loading.py), and fuse as their dequantized values would.

- `layer_kv` gives a layer's floats on the device (codes moved first, then dequantized), `dequantized`
  the whole chunk; float chunks are unchanged by either.
- The layer loader places quantized chunks bit for bit as it places their dequantized floats, from every
  place a chunk can live (the CUDA half: page-locked host memory and the device).
- From a real store in each format, with the default model: at r = 1 every context row is recomputed, so
  the stored values cannot matter and the fused prefill is vanilla's (logits and greedy tokens); at the
  default ratio it runs and answers.
"""

from __future__ import annotations

import pytest
import torch
from test_fusion_architectures import build, chunks_of

from kvfuse import kv_formats
from kvfuse.fusion import ChunkKV, FusionEngine, FusionOptions, GenerationOptions
from kvfuse.fusion.engine import solo
from kvfuse.fusion.engine.fused_cache import FusedCache
from kvfuse.fusion.kv_loading import LayerLoader

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda,
                                              pytest.mark.skipif(not CUDA, reason="no CUDA device")])]
FORMATS = list(kv_formats.QUANTIZED)
FULL = dict(recompute_ratio=1.0, edge_tokens=1000, edge_tokens_end=1000)


def _quantized(c: ChunkKV, fmt: str) -> ChunkKV:
    return ChunkKV(c.token_ids, *kv_formats.encode_kv(c.k, c.v, fmt), after_context=c.after_context)


def test_layer_kv_gives_a_layers_floats_and_dequantized_the_whole_chunk(tokenizer) -> None:
    eng = FusionEngine(build("llama3-rope", len(tokenizer)), tokenizer, dtype="float32")
    chunk = eng.precompute(chunks_of(eng, [70]))[0]
    k, v = chunk.layer_kv(1, "cpu")
    assert torch.equal(k, chunk.k[1]) and torch.equal(v, chunk.v[1]) and chunk.dequantized() is chunk
    assert chunk.layer_kv(1, "cpu", torch.float16)[0].dtype == torch.float16
    for fmt in FORMATS:
        q = _quantized(chunk, fmt)
        assert q.quantized and q.layer_dtype == torch.float32 and q.k.shape == chunk.k.shape
        whole = q.dequantized()
        assert not whole.quantized and torch.equal(whole.k, q.k.dequantize()) and torch.equal(whole.v, q.v.dequantize())
        k, v = q.layer_kv(1, "cpu")
        assert torch.equal(k, whole.k[1]) and torch.equal(v, whole.v[1])
        assert float((k - chunk.k[1]).norm() / chunk.k[1].norm()) < 0.15  # what a 4-bit format keeps, at worst


def _load(eng: FusionEngine, chunks: list[ChunkKV], starts: list[int], total: int) -> FusedCache:
    cache = FusedCache(eng.num_layers, eng.num_kv_heads, eng.head_dim, total, eng.dtype, eng.device)
    cache.loader = LayerLoader(cache, eng.rope, chunks, starts, True).start()
    cache.finish_loading()
    return cache


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_loader_places_quantized_chunks_as_their_floats(tokenizer, device: str, fmt: str) -> None:
    eng = FusionEngine(build("llama3-rope", len(tokenizer)).to(device=device, dtype=torch.bfloat16), tokenizer,
                       dtype="bfloat16")
    floats = eng.precompute(chunks_of(eng, [40, 33, 47]))
    stored = [_quantized(ChunkKV(c.token_ids, c.k.cpu(), c.v.cpu()), fmt) for c in floats]
    starts, total = [7, 47, 80], 127
    want = _load(eng, [c.dequantized() for c in stored], starts, total)
    sources = {"pageable": stored}
    if device == "cuda":
        sources["pinned"] = [ChunkKV(c.token_ids, c.k.to("cpu"), c.v.to("cpu")) for c in stored]
        for c in sources["pinned"]:
            for part in (*c.k.parts(), *c.v.parts()):
                part.data = part.pin_memory()
        sources["device"] = [ChunkKV(c.token_ids, c.k.to(device), c.v.to(device)) for c in stored]
    mixed = [stored[0], floats[1], stored[2]]  # a float chunk (kvlink's link slots) among quantized ones
    ctx = slice(starts[0], total)  # what the loader placed (the prefix is placed apart)
    for name, src in sources.items():
        got = _load(eng, src, starts, total)
        assert torch.equal(got.k[:, :, ctx], want.k[:, :, ctx]) and torch.equal(got.v[:, :, ctx], want.v[:, :, ctx]), name
    got = _load(eng, mixed, starts, total)
    assert torch.equal(got.k[:, :, 47:80], _load(eng, floats, starts, total).k[:, :, 47:80])
    assert torch.equal(got.k[:, :, 80:total], want.k[:, :, 80:total])


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_from_a_quantized_store_r1_is_vanilla_and_the_default_ratio_answers(
        fmt: str, engine: FusionEngine, prompt, settings_factory) -> None:
    from kvfuse.store import KVStore

    settings = settings_factory(redis_url="", store={"kv_dtype": fmt, "hot_tier_mb": 0})
    with KVStore.open(settings) as store:
        keys = [store.put_kv(engine.fingerprint, fmt, c.token_ids, c.k, c.v)[0] for c in prompt.chunks]
        loaded = []
        for key, c in zip(keys, prompt.chunks, strict=True):
            k, v, header = store.load_chunk(key)
            assert header.dtype == fmt and isinstance(k, kv_formats.QTensor)
            loaded.append(ChunkKV(c.token_ids, k, v))
    gen = GenerationOptions(max_tokens=6)
    vanilla = engine.fuse(prompt.prefix, [ChunkKV(c.token_ids) for c in prompt.chunks], prompt.question_ids,
                          FusionOptions(method="vanilla"))
    *_, want = solo.generate(engine, prompt.prefix, prompt.chunks, prompt.question_ids, FusionOptions(method="vanilla"), gen)
    for method in ("anchor", "cacheblend"):
        full = engine.fuse(prompt.prefix, loaded, prompt.question_ids, FusionOptions(method=method, **FULL))
        torch.testing.assert_close(full.logits, vanilla.logits, atol=2e-4, rtol=1e-4)
        *_, got = solo.generate(engine, prompt.prefix, loaded, prompt.question_ids, FusionOptions(method=method, **FULL), gen)
        assert got.token_ids == want.token_ids, method
    *_, default = solo.generate(engine, prompt.prefix, loaded, prompt.question_ids,
                                  FusionOptions(method="anchor", recompute_ratio=0.15), gen)
    assert len(default.token_ids) == 6 and default.stats["recomputed_tokens"] > 0
