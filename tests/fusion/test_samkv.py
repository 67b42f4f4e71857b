"""samkv: pinned to vanilla when it keeps and recomputes everything, its block selection on a constructed
example, the loaded share it reports, and its artifacts in the blob (old blobs still load)."""

from __future__ import annotations

import pytest
import torch
from fusion_helpers import hf_forward, make_prompt

from kvfuse.fusion import FusionOptions, GenerationOptions
from kvfuse.fusion.engine import solo
from kvfuse.fusion.methods.samkv import artifacts_for
from kvfuse.fusion.methods.sparse import artifacts as arts_mod
from kvfuse.fusion.methods.sparse.blocks import Segments, stable_layers
from kvfuse.fusion.methods.sparse.select import DocInputs, select_blocks
from kvfuse.fusion.methods.sparse.source import MemorySource

pytestmark = pytest.mark.slow

ATOL = 2e-4  # as test_fusion_engine: fp32 logits of a 30-layer model


@pytest.fixture(scope="module")
def long_prompt(engine, essay_text):
    """Three chunks of 5, 3 and 7 blocks (the first and last with middle blocks), ~1000 tokens."""
    return make_prompt(engine, essay_text, "What does the author think of the App Store?", [300, 150, 420])


def test_everything_kept_and_recomputed_equals_vanilla(engine, long_prompt):
    ref = hf_forward(engine, long_prompt.ids, logits_to_keep=1).logits[0, -1].float()
    opts = FusionOptions(method="samkv", recompute_ratio=1.0, samkv_min_p=1.0, samkv_cross_cut=False,
                         samkv_update="overwrite")
    fused = engine.fuse(long_prompt.prefix, long_prompt.chunks, long_prompt.question_ids, opts)
    n = sum(len(c) for c in long_prompt.chunks)
    assert fused.stats["sparse_context_tokens"] == fused.stats["recomputed_tokens"] == n
    assert fused.stats["kv_loaded_bytes"] == fused.stats["kv_total_bytes"]
    torch.testing.assert_close(fused.logits, ref, atol=ATOL, rtol=0)


def test_default_samkv_loads_a_share_and_decodes(engine, long_prompt):
    sources = [MemorySource(c) for c in long_prompt.chunks]
    fused = engine.fuse(long_prompt.prefix, sources, long_prompt.question_ids, FusionOptions(method="samkv"))
    st = fused.stats
    # the loaded share is what the reads took: every kept block of every chunk, nothing else
    assert st["kv_loaded_bytes"] == sum(s.loaded_bytes for s in sources)
    assert st["kv_total_bytes"] == sum(c.k.nbytes + c.v.nbytes for c in long_prompt.chunks)
    per_token = long_prompt.chunks[0].k[:, :, :1].nbytes * 2
    assert st["kv_loaded_bytes"] == st["sparse_context_tokens"] * per_token
    assert st["fused_cache_tokens"] == st["prefix_tokens"] + st["sparse_context_tokens"] + st["question_tokens"]
    anchors = sum(len(Segments(len(c)).token_list(Segments(len(c)).anchor)) for c in long_prompt.chunks)
    assert anchors <= st["sparse_context_tokens"] < st["context_tokens"]
    *_, result = solo.generate(engine, long_prompt.prefix, long_prompt.chunks, long_prompt.question_ids,
                                 FusionOptions(method="samkv"), GenerationOptions(max_tokens=4))
    assert result.usage["generated_tokens"] >= 1


def test_selection_keeps_anchor_blocks_and_the_targeted_block():
    """A constructed example: 3 documents of 8 blocks; document 1's middle block 4 holds the key the
    query points at; the static max/min blocks are set as the analysis would for that content."""
    torch.manual_seed(0)
    s, h, hkv, d = 2, 4, 2, 16
    q = torch.randn(s, h, d)
    docs = []
    for i in range(3):
        seg = Segments(8 * 64)
        keys = torch.randn(s, hkv, seg.num_blocks, d) * 0.1
        target = 4 if i == 1 else 2
        if i == 1:  # the block the query targets: its key is the query's direction
            keys[:, :, 4] = q.view(s, hkv, h // hkv, d).sum(dim=2) * 0.5
        docs.append(DocInputs(seg, keys, torch.randn(s, h, d) * 0.01, torch.full((s,), target),
                              torch.full((s,), 6 if target != 6 else 5)))
    sel = select_blocks(q, docs)
    for doc, kept in zip(docs, sel.blocks, strict=True):
        assert set(doc.seg.anchor) <= set(kept)  # initial block 0 and local blocks 6, 7
        assert set(doc.seg.anchor) == {0, 6, 7}
    assert 4 in sel.blocks[1]
    assert sel.top_p[1] > 0
    # the cross-document cut: at most (all middle blocks / documents) middle blocks survive
    middle_kept = sum(len(set(k) - set(d.seg.anchor)) for d, k in zip(docs, sel.blocks, strict=True))
    assert middle_kept <= -(-sum(len(d.seg.middle) for d in docs) // len(docs))
    # with every P forced to 1 and no cut, everything is kept
    full = select_blocks(q, docs, min_p=1.0, cross_cut=False)
    assert all(k == list(range(8)) for k in full.blocks)


def test_artifacts_round_trip_through_the_blob(engine, long_prompt):
    from kvfuse import kvblob

    chunk = long_prompt.chunks[0]
    built = arts_mod.build(engine.tf, chunk.token_ids)
    seg = Segments(len(chunk))
    assert built.block_keys.shape == (engine.num_layers, engine.num_kv_heads, seg.num_blocks, engine.head_dim)
    assert built.local_q.shape == (engine.num_layers, engine.tf.num_heads, engine.head_dim)
    assert all(int(b) in seg.middle for b in built.max_block) and all(int(b) in seg.middle for b in built.min_block)
    assert all(int(t) in seg.token_list(seg.middle) for t in built.candidates)
    # the block-mean keys are the stored (post-RoPE) keys rotated back to position 0, averaged
    pos = torch.arange(64)
    cos, sin = engine.rope.cos_sin(pos, torch.float32)
    k0 = arts_mod.apply_rope(chunk.k[:, :, :64], cos, -sin)
    torch.testing.assert_close(built.block_keys[:, :, 0], k0.mean(dim=2), atol=1e-4, rtol=1e-4)
    blob = kvblob.encode(chunk.k, chunk.v, model_fingerprint=engine.fingerprint, token_ids=chunk.token_ids,
                         dtype="float32", artifacts=built.to_tensors())
    k, v, header = kvblob.decode(blob)
    assert torch.equal(k, chunk.k) and header.format_version == 2
    got = arts_mod.Artifacts.from_tensors(header.artifacts, arts_mod.config_tensor(seg, engine.num_layers))
    assert got is not None and torch.equal(got.block_keys, built.block_keys)
    assert torch.equal(got.candidates, built.candidates)
    assert len(stable_layers(engine.num_layers)) == 4
    # absent artifacts are rebuilt on demand, then memoised
    a1, rebuilt1 = artifacts_for(engine, MemorySource(chunk))
    a2, rebuilt2 = artifacts_for(engine, MemorySource(chunk))
    assert a1 is a2 and not rebuilt2


def test_store_reads_only_the_selected_blocks_and_old_blobs_still_serve(engine, long_prompt, settings_factory):
    """Chunks in a real KVStore (LMDB, hot tier off): samkv reads only its kept blocks, and the bytes it
    reports are the bytes the store handed over; a version-1 blob (no blocks, no artifacts) still serves,
    read whole and its artifacts rebuilt, with the same answer."""
    from kvfuse import blob_checksums, kvblob
    from kvfuse.fusion.methods.sparse.source import StoreSource
    from kvfuse.store import KVStore

    settings = settings_factory(redis_url="", store={"hot_tier_mb": 0})
    opts = FusionOptions(method="samkv")
    ref = engine.fuse(long_prompt.prefix, [MemorySource(c) for c in long_prompt.chunks], long_prompt.question_ids, opts)
    with KVStore.open(settings) as store:
        keys = []
        for c in long_prompt.chunks:
            arts, _ = artifacts_for(engine, MemorySource(c))
            key, _ = store.put_kv(engine.fingerprint, "float32", c.token_ids, c.k, c.v, arts.to_tensors())
            keys.append(key)

        def missing():
            raise AssertionError("the store has every chunk")

        sources = [StoreSource(store, k, c.token_ids, missing) for k, c in zip(keys, long_prompt.chunks, strict=True)]
        fused = engine.fuse(long_prompt.prefix, sources, long_prompt.question_ids, opts)
        st = fused.stats
        per_token = long_prompt.chunks[0].k[:, :, :1].nbytes * 2  # fp32 at rest here
        assert st["kv_loaded_bytes"] == st["sparse_context_tokens"] * per_token < st["kv_total_bytes"]
        assert st["rebuilt_artifacts"] == 0
        torch.testing.assert_close(fused.logits, ref.logits, atol=ATOL, rtol=0)

        # the same chunks as version-1 blobs: every byte is read, artifacts are rebuilt (memoised here)
        for key, c in zip(keys, long_prompt.chunks, strict=True):
            store.blobs.remove(key)
            k32, v32 = c.k.contiguous(), c.v.contiguous()
            crc = blob_checksums.checksum(blob_checksums.bytes_view(k32), blob_checksums.bytes_view(v32))
            old = kvblob.KVHeader(1, engine.fingerprint, "float32", *k32.shape[:2], k32.shape[3], k32.shape[2],
                                  kvblob.token_hash(c.token_ids), "rope0", crc)
            assert store.put_chunk(key, kvblob.pack(k32, v32, old))
            header = store.load_artifacts(key)
            assert header.format_version == 1 and header.artifacts is None
        sources = [StoreSource(store, k, c.token_ids, missing) for k, c in zip(keys, long_prompt.chunks, strict=True)]
        fused = engine.fuse(long_prompt.prefix, sources, long_prompt.question_ids, opts)
        assert fused.stats["kv_loaded_bytes"] == fused.stats["kv_total_bytes"]
        torch.testing.assert_close(fused.logits, ref.logits, atol=ATOL, rtol=0)


def test_sparse_cache_is_the_sparse_prompt_at_compacted_positions(engine, long_prompt, monkeypatch):
    """Whatever it keeps, the sparse cache is exact for the kept tokens at their compacted positions: at
    r = 0 its layer-0 keys equal a fresh projection of the sparse prompt (each kept block rotated by its
    move), and at r = 1 with `overwrite` its logits equal vanilla's on the sparse prompt."""
    import kvfuse.fusion.methods.samkv as samkv_module

    seen = {}

    def spy(*args, **kwargs):
        seen["sel"] = select_blocks(*args, **kwargs)
        return seen["sel"]

    monkeypatch.setattr(samkv_module, "select_blocks", spy)
    p = long_prompt
    fused = engine.fuse(p.prefix, p.chunks, p.question_ids,
                        FusionOptions(method="samkv", recompute_ratio=0.0, samkv_update="overwrite"))
    kept = [c.token_ids[t] for c, b in zip(p.chunks, seen["sel"].blocks, strict=True)
            for t in Segments(len(c)).token_list(b)]
    assert len(kept) < sum(len(c) for c in p.chunks)  # something was dropped: positions did move
    sparse = p.prefix.token_ids + kept + p.question_ids
    pos = torch.arange(len(sparse))
    cos, sin = (t.unsqueeze(1) for t in engine.rope.cos_sin(pos, engine.dtype))
    with torch.inference_mode():
        _, k0, _ = engine.tf.project(0, engine.tf.embed(torch.tensor(sparse)), cos, sin)
    torch.testing.assert_close(fused.cache.k[0, :, : len(sparse)], k0[0], atol=1e-3, rtol=1e-3)
    full = engine.fuse(p.prefix, p.chunks, p.question_ids,
                       FusionOptions(method="samkv", recompute_ratio=1.0, samkv_update="overwrite"))
    ref = hf_forward(engine, sparse, logits_to_keep=1).logits[0, -1].float()
    torch.testing.assert_close(full.logits, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("update", ["overwrite", "fusion"])
def test_on_the_engine_core_the_probe_lives_in_the_request_extent(engine, long_prompt, update, monkeypatch):
    """samkv's probe cache is the start of the request's own extent (the sparse cache then overwrites it),
    so a core whose whole KV memory is that one extent serves it, no cache of the engine's own is made
    (a stand-in `new_cache` that fails, the only way to see that none is asked for), and its first logits
    are those of the standalone fuse, whose probe has a cache of its own."""
    from kvfuse.fusion.engine import outputs as E
    from kvfuse.fusion.engine.core import EngineCore
    from kvfuse.fusion.engine.requests import SchedulerLimits
    from kvfuse.fusion.engine.sequence import Sequence

    opts = FusionOptions(method="samkv", samkv_update=update)
    p = long_prompt
    alone = engine.fuse(p.prefix, [MemorySource(c) for c in p.chunks], p.question_ids, opts, max_tokens=2)
    kv_tokens = len(p.prefix) + sum(len(c) for c in p.chunks) + len(p.question_ids) + 2
    core = EngineCore(engine, SchedulerLimits(max_running=1, kv_budget_tokens=kv_tokens,
                                              prefill_tokens_per_step=256, ingest_share=0.25))
    seq = Sequence(0, p.prefix.token_ids, p.question_ids, opts, GenerationOptions(max_tokens=2, temperature=0.0),
                   kv_tokens=kv_tokens, prefill_tokens=kv_tokens, prefix=p.prefix,
                   chunks=[MemorySource(c) for c in p.chunks])
    rows: list[torch.Tensor] = []
    seq.on_logits = lambda row: rows.append(row.float().clone())
    core.add(seq)

    def no_private_cache(capacity: int):
        raise AssertionError(f"a cache of {capacity} tokens outside the core's KV memory")

    monkeypatch.setattr(engine, "new_cache", no_private_cache)
    out: list = []
    while core.has_work:
        out += core.step()
        assert core.memory.used_tokens <= core.memory.capacity == kv_tokens
    monkeypatch.undo()
    assert not [o for o in out if isinstance(o, E.Failed)]
    assert core.ledger.peak_bytes <= core.ledger.budget_bytes
    torch.testing.assert_close(rows[0], alone.logits.float(), atol=ATOL, rtol=0)
