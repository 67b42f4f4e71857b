"""Every supported family proven against its own full prefill, on a tiny random-weight model built from
its transformers config class (tests/tiny_models.py): the engine's full prefill and decode equal
transformers' forward; every fusion method at ratio 1.0 equals the full prefill (or refuses the model,
saying why); a chunk cache moved to another position equals the one computed there; a batch of
requests decodes each as it would alone; and the load check passes. The prompts are longer than every
sliding window in the tiny models, so local layers attend to their window alone."""

from __future__ import annotations

import pytest
import tiny_models
import torch
from transformers import DynamicCache

from kvfuse.fusion import ChunkKV, FusionEngine, FusionOptions
from kvfuse.fusion.errors import MethodRefusedError
from kvfuse.fusion.model.check import check_model

STEPS = 5
SIZES = [7, 40, 33, 47, 9]  # prefix, three chunks, question: 136 tokens, over every window


@pytest.fixture(scope="module", params=list(tiny_models.FAMILIES))
def fam(request, tokenizer) -> FusionEngine:
    engine = FusionEngine(tiny_models.build(request.param, len(tokenizer)), tokenizer, dtype="float32",
                          attention_block_rows=32)
    engine.stop_token_ids = set()  # random weights: compare raw continuations
    return engine


def token_ids(sizes: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 40000, (n,), generator=g).tolist() for n in sizes]


def hf(engine: FusionEngine, ids: list[int]):
    """transformers' forward with a cache that keeps every layer's keys (a sliding layer's too)."""
    with torch.inference_mode():
        return engine.model(torch.tensor([ids]), use_cache=True, past_key_values=DynamicCache())


def windowed(engine: FusionEngine) -> bool:
    return any(w is not None for w in engine.tf.windows)


def test_the_tiny_models_have_what_their_family_is_known_for(fam) -> None:
    tf, family = fam.tf, fam.family.model_type
    if family in ("gemma2", "gemma3_text", "mistral", "phi3", "qwen3"):
        assert windowed(fam) and min(w for w in tf.windows if w) < sum(SIZES)
    if family in ("gemma2", "gemma3_text"):
        assert tf.head_dim == 256 and any(w is None for w in tf.windows)  # local and global layers
    assert (tf.softcap is not None) == (family == "gemma2")
    if family == "gemma3_text":  # two rope bases: the local layers' and the global layers'
        assert tf.rope_of(0) is not tf.rope_of(2) and tf.rope is tf.rope_of(2)
    if family == "phi3":
        assert tf.rope.dim < tf.head_dim and fam.max_context_tokens == tiny_models.LONGROPE_ORIGINAL


def test_prefill_and_decode_equal_transformers(fam) -> None:
    (ids,) = token_ids([sum(SIZES)])
    fused = fam.fuse(None, [], ids, FusionOptions(method="vanilla"), max_tokens=STEPS)
    tokens = [int(torch.argmax(fused.logits))]
    logits = [fused.logits]
    for _ in range(STEPS - 1):
        logits.append(fam.decode_step(fused.cache, tokens[-1]))
        tokens.append(int(torch.argmax(logits[-1])))
    ref = hf(fam, ids + tokens[:-1])
    n = len(ids)
    torch.testing.assert_close(torch.stack(logits), ref.logits[0, n - 1 :].float(), atol=1e-4, rtol=1e-4)
    for layer, ref_layer in enumerate(ref.past_key_values.layers):
        torch.testing.assert_close(fused.cache.k[layer, :, : n + STEPS - 1], ref_layer.keys[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(fused.cache.v[layer, :, : n + STEPS - 1], ref_layer.values[0], atol=1e-4, rtol=1e-4)
    with torch.inference_mode():
        greedy = fam.model.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, n:].tolist()
    assert tokens == greedy


METHODS = ["anchor", "a3", "cacheblend", "prophetkv", "epic", "samkv"]  # every method recomputing by selection


@pytest.mark.parametrize("method", METHODS)
def test_every_method_at_full_ratio_is_the_full_prefill(fam, method: str) -> None:
    prefix_ids, *chunk_ids, question = token_ids(SIZES)
    kvs = fam.precompute([prefix_ids, *chunk_ids])
    vanilla = fam.fuse(kvs[0], kvs[1:], question, FusionOptions(method="vanilla"))
    global_layers = [i for i, w in enumerate(fam.tf.windows) if w is None and i >= 1]
    options = FusionOptions(method=method, recompute_ratio=1.0, edge_tokens=1000, edge_tokens_end=1000,
                            samkv_min_p=1.0, samkv_cross_cut=False, samkv_update="overwrite",
                            check_layer=global_layers[0] if global_layers else 1)
    if method == "samkv" and windowed(fam):
        with pytest.raises(MethodRefusedError, match="sliding-window"):
            fam.fuse(kvs[0], kvs[1:], question, options)
        return
    if method == "a3" and not global_layers:  # every layer local (Mistral, Phi-3 here): no check layer serves
        with pytest.raises(MethodRefusedError, match="check layer 1 is a sliding-window layer"):
            fam.fuse(kvs[0], kvs[1:], question, options)
        return
    fused = fam.fuse(kvs[0], kvs[1:], question, options)
    torch.testing.assert_close(fused.logits, vanilla.logits, atol=1e-4, rtol=1e-4)
    n = sum(SIZES)
    torch.testing.assert_close(fused.cache.k[:, :, :n], vanilla.cache.k[:, :, :n], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused.cache.v[:, :, :n], vanilla.cache.v[:, :, :n], atol=1e-4, rtol=1e-4)


def test_a3_refuses_a_local_check_layer_and_eviction_refuses_windows(fam) -> None:
    prefix_ids, *chunk_ids, question = token_ids(SIZES)
    kvs = fam.precompute([prefix_ids, *chunk_ids])
    local = [i for i, w in enumerate(fam.tf.windows) if w is not None]
    if not local:
        fam.fuse(kvs[0], kvs[1:], question, FusionOptions(method="anchor", evict_capacity=64))  # served
        return
    with pytest.raises(MethodRefusedError, match=f"check layer {local[0]} is a sliding-window layer"):
        fam.fuse(kvs[0], kvs[1:], question, FusionOptions(method="a3", check_layer=local[0]))
    with pytest.raises(MethodRefusedError, match="eviction compacts"):
        fam.fuse(kvs[0], kvs[1:], question, FusionOptions(method="anchor", evict_capacity=64))


def test_a_moved_chunk_equals_the_one_computed_there(fam) -> None:
    """Layer 0's keys depend on token and position alone: a chunk cached alone and moved by 90 positions
    has the keys transformers computes there. And a chunk cached after its context, rotated back to
    0..n-1 and moved into place again (each layer by its own rope), is the full prefill's cache at every
    layer, and gives its logits."""
    context, chunk, question = token_ids([90, 40, 6], seed=2)
    [before, alone] = fam.precompute([context, chunk])
    fused = fam.fuse(before, [alone], question, FusionOptions(method="pie"))
    ref = hf(fam, context + chunk + question)
    torch.testing.assert_close(fused.cache.k[0, :, 90:130], ref.past_key_values.layers[0].keys[0, :, 90:130],
                               atol=1e-4, rtol=1e-4)
    after = fam.precompute_after(context, chunk)
    assert after.after_context and after.k.shape[2] == 40
    fused = fam.fuse(before, [after], question, FusionOptions(method="pie"))
    for layer, ref_layer in enumerate(ref.past_key_values.layers):
        torch.testing.assert_close(fused.cache.k[layer, :, :136], ref_layer.keys[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(fused.cache.v[layer, :, :136], ref_layer.values[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused.logits, ref.logits[0, -1].float(), atol=1e-4, rtol=1e-4)


def test_a_batch_gives_each_request_its_solo_tokens(fam) -> None:
    prompts = [token_ids(sizes, seed=s) for s, sizes in ((3, [6, 50, 30, 8]), (4, [6, 20, 5]), (5, [6, 70, 44, 12]))]

    def fused(parts):
        kvs = fam.precompute(parts[:-1])
        return fam.fuse(kvs[0], kvs[1:], parts[-1], FusionOptions(method="anchor", recompute_ratio=0.3),
                        max_tokens=STEPS)

    alone = []
    for parts in prompts:
        f = fused(parts)
        tokens = [int(torch.argmax(f.logits))]
        for _ in range(STEPS - 1):
            tokens.append(int(torch.argmax(fam.decode_batch([f.cache], torch.tensor([tokens[-1]]))[0])))
        alone.append(tokens)
    batch = [fused(parts) for parts in prompts]
    tokens = [[int(torch.argmax(f.logits))] for f in batch]
    for _ in range(STEPS - 1):
        logits = fam.decode_batch([f.cache for f in batch], torch.tensor([t[-1] for t in tokens]))
        for i, row in enumerate(logits):
            tokens[i].append(int(torch.argmax(row)))
    assert tokens == alone


def test_the_load_check_passes(fam) -> None:
    report = check_model(fam)
    assert report.ok, report.summary()
    names = [r.name for r in report.results]
    assert names[:3] == ["forward", "decode", "recovery"] and "fused:anchor" in names
    assert report.tokens > min((w for w in fam.tf.windows if w), default=0)


def test_a_chunk_cache_computed_with_a_window_keeps_every_key(fam) -> None:
    """Precompute runs transformers' forward with a cache that keeps a sliding layer's every key: a chunk
    longer than the window is stored whole."""
    [kv] = fam.precompute(token_ids([60]))
    assert isinstance(kv, ChunkKV) and kv.k.shape == (fam.num_layers, fam.num_kv_heads, 60, fam.head_dim)


@pytest.fixture
def one_thread():
    """The CPU's bfloat16 kernels on one thread: on a busy 2-core machine two threads wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("family", list(tiny_models.FAMILIES))
def test_the_load_check_passes_in_bfloat16(tokenizer, one_thread, family: str) -> None:
    """bfloat16, the dtype GPU deployments run (float16 is measured in docs/DESIGN.md, "The load check"),
    weights in it as transformers loads them (the rotary module's inv_freq stays float32): every
    check within what the dtype's rounding allows (kvfuse/fusion/model/check.py, `tolerance`)."""
    model = tiny_models.build(family, len(tokenizer), dtype=torch.bfloat16)
    engine = FusionEngine(model, tokenizer, dtype="bfloat16", attention_block_rows=32)
    engine.stop_token_ids = set()
    report = check_model(engine)
    assert report.ok, report.summary()
    assert [r.verdict for r in report.results[:3]] == ["ok"] * 3
