"""samkv (SamKV, "Sparse Attention across Multiple-context KV Cache"): load and attend over a sparse
share of the chunks' KV, recomputing a few tokens inside it.

The pipeline (paper Sec. 3; pieces in kvfuse/fusion/methods/sparse/):
1. Artifacts: each chunk's block-mean keys, mean local query and static attention analysis, kept in its
   blob (ingest) or rebuilt by the analysis pass when absent (kept in this process's LRU).
2. Probe: the initial + local blocks of every chunk (the only KV read so far) form a compact cache
   after the prefix; the question runs through every layer over it; its mean pre-RoPE query on the
   stable layers N* is Q_que.
3. Selection: personalised query per document (Eq. 1), adaptive Top-P (Eqs. 2-3), cross-document cut
   (sparse/select.py). Then only the selected middle blocks are read from the source (the store reads
   them alone).
4. The sparse cache: prefix, then per chunk its kept blocks in order, then the question, at compacted
   positions: every kept block's keys are rotated from their chunk position to their sparse-cache one
   (the rotation is exact, kvfuse/fusion/model/rope.py). Decoding continues from the sparse cache's end.
5. Local recomputation inside the sparse set: round(r * sparse context) tokens, the PauTa candidates of
   the kept middle blocks first, then the initial/local tokens the probe's question attended to most
   (stable layers, heads and question rows averaged), then the other kept tokens. They and the question
   run through every layer over the sparse cache; each recomputed context row's K/V is written with the
   update rule `samkv_update`: "overwrite", or "fusion" (Eq. 4: theta new + (1 - theta) old, theta =
   cos(new, old) per token and layer, over its heads, for K and V each).
6. The question's rows are prefilled in that same pass, after the context rows of each layer are
   written: in a causal model that is the paper's second prefill of the query over the updated cache.

Departures, and why:
- One block selection for all layers, from scores averaged over N* (the paper selects per layer, then
  pads layers to align them, Sec. 3.3 rules 1-2). With one selection the sparse cache is one compact
  sequence every layer shares, which the engine's cache, attention and decoding take as is; per-layer
  sets would need per-layer masks in every attention call and during decoding.
- Positions are compacted (the paper says nothing on RoPE): the cache holds no gaps, so its size is the
  sparse size, and decoding runs at the next compact position.
- The recompute budget is a share of the sparse context (`recompute_ratio`), not of the full one.
- N* is the last ceil(L / 8) layers, not derived per model (sparse/blocks.py).
- `samkv_min_p` (a floor on P) and `samkv_cross_cut` are not in the paper; their defaults (0, on) are the
  paper's method; min_p = 1 with the cut off keeps every block (the test that pins samkv to vanilla).

Refused for models with sliding-window layers (`window_refusal`): the sparse cache compacts positions,
so a local layer's window would cover other tokens than the model's, and the analysis pass and the
probe score every block against every key, which a local layer never sees.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Generator
from typing import ClassVar

import torch

from kvfuse.fusion.engine.fused_cache import FusedCache
from kvfuse.fusion.methods import scoring
from kvfuse.fusion.methods.base import FusionMethod, register
from kvfuse.fusion.methods.sparse import artifacts as arts_mod
from kvfuse.fusion.methods.sparse.blocks import Segments, stable_layers
from kvfuse.fusion.methods.sparse.select import DocInputs, select_blocks
from kvfuse.fusion.methods.sparse.source import BlockSource, MemorySource
from kvfuse.fusion.model.rope import apply_rope
from kvfuse.fusion.types import ChunkKV, FusedPrefill, Layout

_REBUILT_KEPT = 1024  # artifacts rebuilt in this process, kept by chunk content (LRU)
_rebuilt: OrderedDict[tuple, arts_mod.Artifacts] = OrderedDict()
_rebuilt_lock = threading.Lock()


def artifacts_for(engine, source: BlockSource) -> tuple[arts_mod.Artifacts, bool]:
    """(artifacts, rebuilt): the stored ones, else the analysis pass's (memoised by content)."""
    expected = arts_mod.config_tensor(source.seg, engine.num_layers)
    stored = source.stored_artifacts(expected)
    if stored is not None:
        return stored, False
    key = (engine.fingerprint, tuple(source.token_ids))
    with _rebuilt_lock:
        hit = _rebuilt.get(key)
        if hit is not None:
            _rebuilt.move_to_end(key)
            return hit, False
    built = arts_mod.build(engine.tf, source.token_ids, source.seg)
    with _rebuilt_lock:
        _rebuilt[key] = built
        while len(_rebuilt) > _REBUILT_KEPT:
            _rebuilt.popitem(last=False)
    return built, True


class BlendCache(FusedCache):
    """A FusedCache whose writes below `blend_below` (context rows) follow Eq. 4:
    new <- theta new + (1 - theta) old, theta = cos(new, old) per row over its heads, K and V each."""

    blend_below = 0

    @classmethod
    def viewing(cls, cache: FusedCache) -> BlendCache:
        """The same extent as `cache`, written through the blend."""
        return cls.in_memory(cache.memory, cache.extent, cache.capacity)

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        ctx = positions < self.blend_below
        if bool(ctx.any()):
            k, v = k.clone(), v.clone()
            idx = positions[ctx]
            for new, store in ((k, self.k), (v, self.v)):
                old = store[layer].index_select(1, idx).float()  # [Hkv, R, D]
                cur = new[0][:, ctx].float()
                theta = torch.nn.functional.cosine_similarity(
                    cur.transpose(0, 1).reshape(idx.numel(), -1), old.transpose(0, 1).reshape(idx.numel(), -1), dim=-1)
                blended = theta.view(1, -1, 1) * cur + (1 - theta).view(1, -1, 1) * old
                new[0][:, ctx] = blended.to(new.dtype)
        super().write(layer, positions, k, v)


def as_source(chunk) -> BlockSource:
    return chunk if isinstance(chunk, BlockSource) else MemorySource(chunk)


@register
class SamKV(FusionMethod):
    name = "samkv"
    own_pipeline: ClassVar[bool] = True
    window_refusal: ClassVar[str | None] = (
        "its sparse cache compacts positions, so a sliding-window layer would see other tokens than the model's "
        "window, and its block scores assume every layer sees every key")

    def pipeline(self, engine, prefix: ChunkKV, chunks: list, question_ids: list[int], options,
                 max_tokens: int, new_cache) -> Generator[int, None, FusedPrefill]:
        tf, device, num_layers = engine.tf, engine.device, engine.num_layers
        if not prefix.has_kv:
            raise ValueError("prefix: token ids only, no KV (samkv needs the prefix's KV)")
        sources = [as_source(c) for c in chunks]
        p, qn = len(prefix), len(question_ids)
        n = sum(len(s) for s in sources)
        engine.check_context(p + n + qn, max_tokens)
        timings = {"kv_load_s": 0.0, "artifacts_s": 0.0, "assemble_s": 0.0, "select_s": 0.0, "recompute_s": 0.0}
        stable = stable_layers(num_layers)

        t = time.perf_counter()
        built = [artifacts_for(engine, s) for s in sources]
        timings["artifacts_s"] = time.perf_counter() - t
        t = time.perf_counter()
        anchor_kv = [s.read(s.seg.anchor) for s in sources]
        timings["kv_load_s"] += time.perf_counter() - t

        # 2. the probe over prefix + initial/local blocks + question
        t = time.perf_counter()
        anchor_blocks = [s.seg.anchor for s in sources]
        # The probe lives at the start of the request's own cache (on the engine core, its extent, sized for
        # the whole prompt, which the probe never exceeds): the sparse cache overwrites it below, so the
        # probe holds no KV outside the ledger (docs/DESIGN.md, "One device-memory ledger").
        probe_cache, probe_layout = self._assemble(engine, prefix, sources, anchor_blocks, anchor_kv, qn, 0,
                                                   new_cache)
        q_ids = torch.tensor(question_ids, dtype=torch.long, device=device)
        q_que, anchor_attn = yield from self._probe(engine, probe_cache, probe_layout, q_ids, stable)
        timings["select_s"] += time.perf_counter() - t

        # 3. selection, then the selected middle blocks are read
        t = time.perf_counter()
        docs = [DocInputs(s.seg, a.block_keys[stable.start:], a.local_q[stable.start:], a.max_block[stable.start:],
                          a.min_block[stable.start:]) for s, (a, _) in zip(sources, built, strict=True)]
        sel = select_blocks(q_que.cpu(), docs, min_p=options.samkv_min_p, cross_cut=options.samkv_cross_cut)
        timings["select_s"] += time.perf_counter() - t
        t = time.perf_counter()
        kept_kv = []
        for s, blocks, (ak, av) in zip(sources, sel.blocks, anchor_kv, strict=True):
            middle = [b for b in blocks if b not in s.seg.anchor]
            mk, mv = s.read(middle) if middle else (ak[:, :, :0], av[:, :, :0])
            kept_kv.append(_merge_blocks(s.seg, blocks, s.seg.anchor, (ak, av), middle, (mk, mv)))
        timings["kv_load_s"] += time.perf_counter() - t

        # 4. the sparse cache
        t = time.perf_counter()
        make = new_cache
        if options.samkv_update == "fusion":  # the same memory, written through Eq. 4
            make = lambda capacity: BlendCache.viewing(new_cache(capacity))  # noqa: E731
        cache, layout = self._assemble(engine, prefix, sources, sel.blocks, kept_kv, qn, max_tokens, make)
        cache.blend_below = layout.question_start
        timings["assemble_s"] = time.perf_counter() - t

        # 5-6. local recomputation + the question, over the sparse cache
        t = time.perf_counter()
        selected = self._recompute_set(sources, sel.blocks, built, anchor_attn, probe_layout, layout, options)
        local = torch.cat([selected, torch.arange(layout.context_len, layout.context_len + qn, device=device)])
        rows = engine.rows(local + p)
        ids = torch.tensor(prefix.token_ids + [t_ for s, b in zip(sources, sel.blocks, strict=True)
                                               for t_ in _block_tokens(s, b)] + list(question_ids),
                           dtype=torch.long, device=device)
        h = yield from engine._layers(cache, tf.embed(ids[rows.positions]), rows, range(num_layers))
        timings["recompute_s"] = time.perf_counter() - t
        cache.length = layout.total
        logits = tf.logits(h[:, -1])[0]
        loaded = sum(s.loaded_bytes for s in sources)
        total_bytes = sum(s.total_bytes for s in sources)
        stats = {
            "prefix_tokens": p, "context_tokens": n, "question_tokens": qn,
            "recomputed_tokens": int(selected.numel()), "full_layers": 0,
            "sparse_context_tokens": layout.context_len, "fused_cache_tokens": layout.total,
            "kv_loaded_bytes": int(loaded), "kv_total_bytes": int(total_bytes),
            "rebuilt_artifacts": sum(int(r) for _, r in built),
        }
        return FusedPrefill(cache, logits, selected + p, stats, timings)

    # -- pieces ------------------------------------------------------------------------------------------
    @staticmethod
    def _assemble(engine, prefix: ChunkKV, sources: list[BlockSource], blocks: list[list[int]],
                  kvs: list[tuple[torch.Tensor, torch.Tensor]], qn: int, spare: int, make):
        """prefix + each chunk's `blocks` (their K/V in `kvs`, in block order) at compacted positions,
        room for the question and `spare` more tokens; keys rotated block by block."""
        layout = Layout(len(prefix), [k.shape[2] for k, _ in kvs], qn)
        cache = make(layout.total + spare)
        cache.place(0, prefix.k, prefix.v)
        for s, bl, (k, v), start in zip(sources, blocks, kvs, layout.chunk_starts(), strict=True):
            cache.place(start, k.to(engine.device), v.to(engine.device))
            at = start
            for b in bl:
                toks = s.seg.tokens(b)
                engine.tf.shift_keys_(cache.k[:, :, at : at + len(toks)], at - toks.start)
                at += len(toks)
        return cache, layout

    @staticmethod
    def _probe(engine, cache: FusedCache, layout: Layout, q_ids: torch.Tensor, stable: range
               ) -> Generator[int, None, tuple[torch.Tensor, torch.Tensor]]:
        """The question through every layer over the probe cache: (Q_que [S, H, D], the question's attention
        onto each context token of the probe cache averaged over N*, heads and rows [N])."""
        tf = engine.tf
        positions = torch.arange(layout.question_start, layout.total, device=engine.device)
        rows = engine.rows(positions)
        h = tf.embed(q_ids)
        q_que, attn = [], torch.zeros(layout.context_len, device=engine.device)
        for layer in range(tf.num_layers):
            cos, sin = rows.cos_sin(layer)
            q, k, v = tf.project(layer, h, cos, sin)
            cache.write(layer, positions, k, v)
            if layer in stable:  # the inverse rotation (cos/sin carry the rope's attention scaling a: divide it out)
                a = tf.rope_of(layer).attention_scaling
                q_que.append(apply_rope(q[0].float(), cos[0].float() / a, -sin[0].float() / a).mean(dim=1))
                probs = scoring.attention_probs(q, positions, cache.keys(layer, layout.total), tf.scale)
                attn += probs[:, :, layout.context_start : layout.question_start].mean(dim=(0, 1)) / len(stable)
            if layer + 1 < tf.num_layers:
                h = tf.finish(layer, h, tf.attend(cache, layer, rows, q))
            yield rows.count
        return torch.stack(q_que), attn

    @staticmethod
    def _recompute_set(sources, blocks, built, anchor_attn, probe_layout: Layout, layout: Layout, options
                       ) -> torch.Tensor:
        """Sparse-context indices to recompute (see the module docstring, step 5)."""
        scores = torch.full((layout.context_len,), -1.0)
        probe_starts, starts = probe_layout.chunk_starts(), layout.chunk_starts()
        p = layout.prefix_len
        attn = anchor_attn.float().cpu()
        for s, bl, (a, _), ps, st in zip(sources, blocks, built, probe_starts, starts, strict=True):
            cand = set(a.candidates.tolist())
            at, probe_at = st - p, ps - p
            for b in bl:
                toks = s.seg.tokens(b)
                if b in s.seg.anchor:
                    scores[at : at + len(toks)] = attn[probe_at : probe_at + len(toks)]
                    probe_at += len(toks)
                else:
                    for j, tok in enumerate(toks):
                        if tok in cand:
                            scores[at + j] = 2.0
                at += len(toks)
        budget = scoring.budget(options.recompute_ratio, layout.context_len)
        return scoring.top_k(scores, budget).to(anchor_attn.device)


def _block_tokens(source: BlockSource, blocks: list[int]) -> list[int]:
    return [source.token_ids[t] for t in source.seg.token_list(blocks)]


def _merge_blocks(seg: Segments, blocks: list[int], first: list[int], first_kv, second: list[int], second_kv):
    """K/V of `blocks` in order, from two reads (`first` blocks in first_kv, `second` in second_kv)."""
    pieces_k, pieces_v = [], []
    offsets = {}
    for group, (k, v) in ((first, first_kv), (second, second_kv)):
        at = 0
        for b in group:
            size = len(seg.tokens(b))
            offsets[b] = (k, v, at, size)
            at += size
    for b in blocks:
        k, v, at, size = offsets[b]
        pieces_k.append(k[:, :, at : at + size])
        pieces_v.append(v[:, :, at : at + size])
    return torch.cat(pieces_k, dim=2), torch.cat(pieces_v, dim=2)
