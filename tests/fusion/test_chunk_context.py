"""Context-carrying chunk caches (kvfuse/fusion/chunk_context.py, FusionEngine.precompute_after).

Pinned to the math: with no context the cache is the chunk cached alone (and its key is unchanged); with
a context it is the chunk's slice of a full prefill of context + chunk; and when every chunk is cached
after its exact preceding prompt, reusing them all with positions recovered and nothing recomputed (`pie`) is a full prefill (`vanilla`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fusion_helpers import Prompt

from kvfuse import kvblob
from kvfuse.fusion import FusionEngine, FusionOptions
from kvfuse.fusion.chunk_context import (
    check_mode,
    document_contexts,
    fill_empty,
    joined,
    nearest_context,
    neighbour_contexts,
    neighbour_order,
    sink_context,
)


def test_none_is_the_chunk_alone(engine: FusionEngine, prompt: Prompt):
    ids = prompt.chunks[1].token_ids
    alone = engine.precompute([ids])[0]
    after = engine.precompute_after([], ids)
    assert torch.equal(alone.k, after.k) and torch.equal(alone.v, after.v)
    fp = engine.fingerprint
    key = kvblob.chunk_key(fp, "float16", ids)
    assert kvblob.chunk_key(fp, "float16", ids, []) == key  # mode none keeps every stored key
    after_12 = kvblob.chunk_key(fp, "float16", ids, [1, 2])
    assert after_12 != key and after_12 != kvblob.chunk_key(fp, "float16", ids, [2, 1])
    # the blob records its context: its header's key is the context key, so the store accepts it there
    blob = kvblob.encode(after.k, after.v, model_fingerprint=fp, token_ids=ids, dtype="float16", context_ids=[1, 2])
    assert kvblob.read_header(blob).key == after_12
    plain = kvblob.encode(after.k, after.v, model_fingerprint=fp, token_ids=ids, dtype="float16")
    assert kvblob.read_header(plain).key == key and b"context_hash" not in plain


def test_document_context_is_the_slice_of_a_full_prefill(engine: FusionEngine, prompt: Prompt):
    context = prompt.chunks[0].token_ids
    ids = prompt.chunks[1].token_ids
    c = len(context)
    full = engine.precompute([context + ids])[0]
    after = engine.precompute_after(context, ids)
    assert after.token_ids == ids and after.k.shape == (engine.num_layers, engine.num_kv_heads, len(ids),
                                                         engine.head_dim)
    assert torch.allclose(after.v, full.v[:, :, c:], atol=1e-5)
    k = after.k.clone()
    engine.rope.shift_keys_(k, c)  # stored at 0..n-1: back to where the prefill had it
    assert torch.allclose(k, full.k[:, :, c:], atol=1e-4)
    # the same chunk cached alone differs: the context reached it
    assert not torch.allclose(engine.precompute([ids])[0].v, full.v[:, :, c:], atol=1e-3)


def test_exact_preceding_context_makes_pie_vanilla(engine: FusionEngine, prompt: Prompt):
    seen = list(prompt.prefix.token_ids)
    chunks = []
    for ch in prompt.chunks:
        chunks.append(engine.precompute_after(seen, ch.token_ids))
        seen += ch.token_ids
    reuse = engine.fuse(prompt.prefix, chunks, prompt.question_ids, FusionOptions(method="pie"))
    vanilla = engine.fuse(prompt.prefix, prompt.chunks, prompt.question_ids, FusionOptions(method="vanilla"))
    assert torch.allclose(reuse.logits, vanilla.logits, atol=1e-3)
    alone = engine.fuse(prompt.prefix, prompt.chunks, prompt.question_ids, FusionOptions(method="pie"))
    assert (reuse.logits - vanilla.logits).abs().max() < (alone.logits - vanilla.logits).abs().max() / 10


def test_sink_is_one_shared_bos_and_the_chunk_its_slice_after_it(engine: FusionEngine, prompt: Prompt):
    sink = sink_context(engine.tokenizer)
    assert sink == [engine.tokenizer.bos_token_id] and check_mode("sink") == "sink"
    ids = prompt.chunks[1].token_ids
    full = engine.precompute([sink + ids])[0]
    after = engine.precompute_after(sink, ids)
    assert after.after_context and torch.allclose(after.v, full.v[:, :, 1:], atol=1e-5)
    # the first content token is no longer a sink of its own: its values are not those of the chunk alone
    alone = engine.precompute([ids])[0]
    assert not torch.allclose(after.v[:, :, 0], alone.v[:, :, 0], atol=1e-3)
    fp = engine.fingerprint
    assert kvblob.chunk_key(fp, "float16", ids, sink) != kvblob.chunk_key(fp, "float16", ids)


def test_context_choice():
    assert check_mode("document") == "document"
    with pytest.raises(ValueError, match="neighbours"):
        check_mode("neighbors")
    chunks = [[1, 2, 3], [4, 5], [6]]
    assert document_contexts(chunks, 4) == [[], [1, 2, 3], [2, 3, 4, 5]]
    assert document_contexts(chunks, 0) == [[], [], []]
    # document_or_neighbours: only the chunks with nothing before them take the fallback, computed once
    asked = []
    filled = fill_empty(document_contexts(chunks, 4), lambda rows: asked.append(rows) or [[9, r] for r in rows])
    assert filled == [[9, 0], [1, 2, 3], [2, 3, 4, 5]] and asked == [[0]]
    assert fill_empty([[1], [2]], lambda rows: pytest.fail("nothing to fill")) == [[1], [2]]
    assert check_mode("document_or_neighbours") == "document_or_neighbours"
    vecs = np.array([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0]])
    # chunk 0: closest is 1, then 2 -> least similar first
    assert neighbour_order(vecs, 2) == [[2, 1], [2, 0], [0, 1]]
    assert neighbour_order(vecs, 1) == [[1], [0], [1]]
    assert neighbour_contexts(chunks, vecs, 2, 3) == [[6, 4, 5], [1, 2, 3], [3, 4, 5]]
    assert joined([[1, 2], [3]], 2) == [2, 3] and joined([[1]], 0) == []
    # scored candidates (the service's neighbours): the 2 best, least similar first, cut to the budget
    scored = [(0.1, [1]), (0.9, [2, 3]), (0.5, [4])]
    assert nearest_context(scored, 2, 8) == [4, 2, 3] and nearest_context(scored, 2, 2) == [2, 3]
    assert nearest_context(scored, 5, 8) == [1, 4, 2, 3] and nearest_context([], 2, 8) == []


def test_anchor_forces_no_chunk_starts_on_chunks_cached_after_a_context(engine: FusionEngine, prompt: Prompt):
    """A chunk cached after a context has no chunk-start sink: `anchor` spends no forced tokens on it
    (its selection is anchor_tokens = 0's), and still forces them on the chunks cached alone."""
    seen = list(prompt.prefix.token_ids)
    after = []
    for ch in prompt.chunks:
        after.append(engine.precompute_after(seen, ch.token_ids))
        seen += ch.token_ids
    assert all(c.after_context for c in after) and not any(c.after_context for c in prompt.chunks)

    def selected(chunks, **knobs):
        opts = FusionOptions(method="anchor", recompute_ratio=0.15, **knobs)
        return engine.fuse(prompt.prefix, chunks, prompt.question_ids, opts).selected.tolist()

    assert selected(after) == selected(after, anchor_tokens=0)
    starts = [len(prompt.prefix) + sum(len(c) for c in prompt.chunks[:i]) for i in range(len(prompt.chunks))]
    mixed = [prompt.chunks[0], *after[1:]]  # the first chunk alone, the rest after their text
    chosen = set(selected(mixed, anchor_tokens=4))
    assert set(range(starts[0], starts[0] + 4)) <= chosen
    assert selected(mixed, anchor_tokens=4) != selected(after, anchor_tokens=4)


def test_the_speed_bench_cold_store_keeps_whether_a_chunk_was_cached_after_a_context(
        engine: FusionEngine, prompt: Prompt, tmp_path):
    """The cold runs of `kvfuse bench speed` read the chunks back from a real store; they must select as
    the warm runs do, so a chunk cached after a context comes back marked so."""
    from types import SimpleNamespace

    from kvfuse.bench.speed import ColdStore
    from kvfuse.config import Settings

    after = engine.precompute_after(prompt.prefix.token_ids, prompt.chunks[0].token_ids)
    # what ColdStore reads of a bench backend; float16 at rest, so the keys come back exactly
    backend = SimpleNamespace(settings=Settings(store={"kv_dtype": "float16"}), engine=engine)
    store = ColdStore(backend, [prompt.prefix, after, prompt.chunks[1]], tmp_path)
    try:
        loaded = store.load()
    finally:
        store.close()
    assert [c.after_context for c in loaded] == [False, True, False]
    assert torch.equal(loaded[1].k, after.k.to(loaded[1].k.dtype))


def test_a_run_of_chunks_in_one_prefill_is_each_chunk_after_its_own_context(engine: FusionEngine, prompt: Prompt):
    """precompute_run: chunk i of one pass over context + chunks is precompute_after(context + chunks[:i],
    chunks[i]): the same tokens at the same positions under a causal mask, equal to fp32 rounding (the
    bound asserted), not bit for bit (the kernels depend on the pass's length), hence store.precompute_runs
    being off by default."""
    context = list(prompt.prefix.token_ids)
    ids = [c.token_ids for c in prompt.chunks[:3]]
    run = engine.precompute_run(context, ids)
    for i, got in enumerate(run):
        want = engine.precompute_after(context + [t for c in ids[:i] for t in c], ids[i])
        assert got.token_ids == ids[i] and got.after_context
        torch.testing.assert_close(got.k, want.k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.v, want.v, atol=1e-5, rtol=1e-5)
    assert engine.precompute_run(context, []) == []


def test_context_runs_group_the_chunks_one_pass_computes_exactly():
    from kvfuse.service.worker.chunk_kv import context_runs

    doc = [[1, 2], [3, 4], [5, 6], [7, 8]]
    # the budget reaches the document's start: chunks 1..3 one run, in document order whatever the order asked
    ctx = document_contexts(doc, 8)
    assert context_runs(doc[1:], ctx[1:]) == [[0, 1, 2]]
    assert context_runs([doc[3], doc[1], doc[2]], [ctx[3], ctx[1], ctx[2]]) == [[1, 2, 0]]
    # a cap of 4 tokens: chunk 3's context starts later (its own pass); chunk 0 is alone (left out)
    capped = document_contexts(doc, 4)
    assert context_runs(doc, capped) == [[1, 2], [3]]
    # a gap (chunk 2 warm, not asked): chunk 3 cannot follow chunk 1 in one pass
    assert context_runs([doc[1], doc[3]], [ctx[1], ctx[3]]) == [[0], [1]]
