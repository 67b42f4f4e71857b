"""Architecture coverage with tiny random-weight models built in-test: Llama with llama3 rope scaling,
Mistral, Qwen2 (qkv bias). r = 1 must reproduce the model's own forward; pie on one chunk its cache.
Rope variants and their limits, and what bounds the context. Every family, window and soft-capping:
tests/fusion/test_families.py."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from kvfuse.fusion import FusionEngine, FusionOptions, GenerationOptions, UnsupportedModelError
from kvfuse.fusion.engine import solo

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def build(kind: str, vocab: int):
    torch.manual_seed(0)
    if kind == "llama3-rope":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, rope_parameters=LLAMA3_ROPE, **SMALL))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(vocab_size=vocab, sliding_window=None, **SMALL))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, **SMALL))
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    return model.eval()


@pytest.fixture(scope="module", params=["llama3-rope", "mistral", "qwen2", "qwen2-dense"])
def tiny(request, tokenizer):
    """The engine on each tiny model; `-dense`: attention by the dense reference path (no blocked CPU kernel)."""
    kind = request.param.removesuffix("-dense")
    block_rows = 0 if request.param.endswith("-dense") else 128
    return FusionEngine(build(kind, len(tokenizer)), tokenizer, dtype="float32", attention_block_rows=block_rows)


def chunks_of(engine, sizes):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(10, 40000, (n,), generator=g).tolist() for n in sizes]


@pytest.mark.parametrize("method", ["a3", "cacheblend", "prophetkv", "epic"])
def test_full_ratio_matches_the_model(tiny, method):
    prefix_ids, *chunk_ids, question_ids = chunks_of(tiny, [5, 40, 33, 47, 9])
    kvs = tiny.precompute([prefix_ids, *chunk_ids])
    all_ids = prefix_ids + sum(chunk_ids, []) + question_ids
    with torch.inference_mode():
        ref = tiny.model(torch.tensor([all_ids]), logits_to_keep=1).logits[0, -1]
        hf_tokens = tiny.model.generate(torch.tensor([all_ids]), max_new_tokens=6, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)[0, len(all_ids):].tolist()
    options = FusionOptions(method=method, recompute_ratio=1.0, edge_tokens=1000, edge_tokens_end=1000)
    fused = tiny.fuse(kvs[0], kvs[1:], question_ids, options)
    torch.testing.assert_close(fused.logits, ref.float(), atol=1e-5, rtol=0)
    tiny.stop_token_ids = set()  # random weights: compare raw continuations
    *_, result = solo.generate(tiny, kvs[0], kvs[1:], question_ids, options, GenerationOptions(max_tokens=6))
    assert result.token_ids == hf_tokens


def test_pie_one_chunk_reproduces_the_cache(tiny):
    chunk, question = chunks_of(tiny, [60, 7])
    [kv] = tiny.precompute([chunk])
    fused = tiny.fuse(None, [kv], question, FusionOptions(method="pie"))
    with torch.inference_mode():
        ref = tiny.model(torch.tensor([chunk + question]), use_cache=True).past_key_values
    for layer, ref_layer in enumerate(ref.layers):
        torch.testing.assert_close(fused.cache.k[layer, :, :67], ref_layer.keys[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fused.cache.v[layer, :, :67], ref_layer.values[0], atol=1e-5, rtol=1e-5)


def test_llama3_rope_recovery_is_exact_at_layer0(tokenizer):
    """Scaled rope: moving a chunk by an offset equals computing it there (layer-0 keys are position-only)."""
    engine = FusionEngine(build("llama3-rope", len(tokenizer)), tokenizer, dtype="float32")
    pre, chunk, question = chunks_of(engine, [300, 50, 4])
    kvs = engine.precompute([pre, chunk])
    fused = engine.fuse(kvs[0], kvs[1:], question, FusionOptions(method="pie"))
    with torch.inference_mode():
        ref = engine.model(torch.tensor([pre + chunk + question]), use_cache=True).past_key_values
    torch.testing.assert_close(fused.cache.k[0, :, 300:350], ref.layers[0].keys[0, :, 300:350], atol=1e-5, rtol=1e-4)


def test_dynamic_ntk_is_served_as_the_plain_rotation_within_the_models_positions(tokenizer):
    """Dynamic NTK rescales only past max_position_embeddings, which the engine never passes: within it
    the rotation is fixed, so stored keys move exactly (the load check's recovery and fused checks)."""
    from kvfuse.fusion.model.check import check_model

    dynamic = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), rope_parameters=dynamic, **SMALL)).eval()
    engine = FusionEngine(model, tokenizer, dtype="float32")
    assert engine.max_context_tokens == SMALL["max_position_embeddings"]
    report = check_model(engine)
    assert report.ok, report.summary()


def test_a_rope_that_is_not_a_rotation_the_engine_knows_is_refused(tokenizer):
    proportional = {"rope_type": "proportional", "rope_theta": 10000.0}
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), rope_parameters=proportional, **SMALL))
    with pytest.raises(UnsupportedModelError, match="proportional"):
        FusionEngine(model, tokenizer, dtype="float32")


def test_longrope_bounds_the_context_where_stored_caches_stop_being_valid(tokenizer):
    """Past original_max_position_embeddings LongRoPE switches every position to its long factors: the
    context stops there, and a longer prompt is refused saying why."""
    import tiny_models

    from kvfuse.fusion import ContextOverflowError

    engine = FusionEngine(tiny_models.build("phi3", len(tokenizer)), tokenizer, dtype="float32")
    assert engine.max_context_tokens == tiny_models.LONGROPE_ORIGINAL < engine.model.config.max_position_embeddings
    prompt = chunks_of(engine, [tiny_models.LONGROPE_ORIGINAL - 4])[0]
    with pytest.raises(ContextOverflowError, match="LongRoPE switches every position to its long factors"):
        engine.fuse(None, [], prompt, FusionOptions(method="vanilla"), max_tokens=8)
    engine.fuse(None, [], prompt, FusionOptions(method="vanilla"), max_tokens=4)  # within it: served


def test_a_sliding_window_no_longer_bounds_the_context(tokenizer):
    """Local layers attend to their window at any length: the context is the model's positions."""
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=len(tokenizer), sliding_window=256, **SMALL))
    engine = FusionEngine(model, tokenizer, dtype="float32")
    assert engine.max_context_tokens == SMALL["max_position_embeddings"] and engine.tf.windows == [256] * 3
