"""The model runner: every decode step of every caller, one sequence or many, over their own caches.

`decode(caches, tokens)` appends one token to each cache at its next slot (rotated to the cache's next
position) and returns each sequence's next-token logits. The B new tokens go through embedding, norms,
projections and MLP as one matrix, so the weights are read once per step whatever B; attention reads
each sequence's own keys, never another's length. The service's engine core, `solo.generate`,
the benchmarks and the shadow checks all decode here (docs/DESIGN.md, "Decoding").

Two ways to run the step:
- eager (the default, and the only way for caches outside the runner's memory): per layer one write
  of the batch's K/V, then one attention call per sequence over a view of its extent (each row reads
  exactly its own keys; a sliding-window layer the last `window` of them);
- static (CUDA graphs, caches in `memory`; what it needs of torch and what only CUDA runs:
  static_support.py): the step as a pure function of fixed-shape tensors -- the
  token ids, positions, write slots and each row's key range, padded to a batch bucket (powers of two
  up to `max_batch`) -- with FlexAttention over the whole memory and a block mask built from those
  ranges, so each row reads only the key blocks of its own extent. The memory never moves or grows, so
  nothing in the step depends on a Python number: it is compiled once per bucket and, on CUDA, captured
  as a CUDA graph per bucket, all in `warm_up` before the service is ready. Padding rows write a
  scratch token the runner owns and read only it.

Capture and the layer loader: graphs are captured in `warm_up`, before any request (so no loader thread
is copying), and with `capture_error_mode="thread_local"`, so a loader thread that allocates or syncs on
its own stream while a capture runs is not an error of the capture.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch
import torch.nn.functional as F

from kvfuse.fusion.engine import static_support
from kvfuse.fusion.engine.fused_cache import FusedCache
from kvfuse.fusion.engine.kv_memory import KVMemory
from kvfuse.fusion.errors import FusionError

log = logging.getLogger("kvfuse.fusion")

BLOCK = 128  # key block of the static path's FlexAttention mask


def buckets(max_batch: int) -> list[int]:
    """Batch sizes the static path is compiled for: powers of two, the last one `max_batch` or above."""
    out = [1]
    while out[-1] < max_batch:
        out.append(out[-1] * 2)
    return out


def _layer_attr(tf, name: str, layer: int, default):
    values = getattr(tf, name, None)
    return values[layer] if values is not None else default


class ModelRunner:
    """Decode steps with the layers of `tf` (kvfuse.fusion.model.transformer.Transformer).

    memory: the KVMemory the engine core's sequences live in (None: callers' own caches only);
    static: run steps whose caches are all in `memory` through the static path; cuda_graphs: capture
    it as CUDA graphs (on a CUDA device only); backend: how the static step is compiled (below)."""

    def __init__(self, tf, memory: KVMemory | None = None, *, max_batch: int = 16, static: bool = False,
                 cuda_graphs: bool = False, backend: str | None = "inductor") -> None:
        self.tf, self.memory, self.max_batch = tf, memory, max_batch
        self.static = static and memory is not None
        device = tf.embed_tokens.weight.device
        self.use_graphs = cuda_graphs and self.static and device.type == "cuda"
        self._steps: dict[int, _StaticStep] = {}
        self._scratch = None
        self.warmup_s = 0.0
        if self.static:
            static_support.require()  # refuse a torch without what the static step calls, saying so
            self._scratch = memory.allocate(("runner", id(self)), 1)
            # Each layer's K and V [Hkv, T, D] go in as inputs of their own, not as views taken inside the
            # compiled step: inductor's CPU FlexAttention kernel was handed the buffer's base for a view of
            # it, so every layer read layer 0's keys (pytorch/pytorch#157612, fixed upstream in #184071);
            # a view that is an input arrives with its own address. The buffer is never reallocated.
            self.layers_k = tuple(memory.k[layer] for layer in range(tf.num_layers))
            self.layers_v = tuple(memory.v[layer] for layer in range(tf.num_layers))
            # inductor: FlexAttention's fused kernel (Triton on CUDA, C++ on the CPU). None runs the same
            # function uncompiled, through FlexAttention's reference implementation (every key's score
            # materialised), and "aot_eager" traces it as inductor would but runs the traced graph so.
            self._kernel = (torch.compile(_static_forward, fullgraph=True, dynamic=False, backend=backend)
                            if backend else _static_forward)
            self._graph_memory = None

    # -- the step -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, caches: list[FusedCache], token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [B], one per cache -> next-token logits [B, vocab] (fp32). Each token is written at
        its cache's `length` and rotated to its `next_position`; every cache's length grows by one."""
        if len(caches) != token_ids.numel():
            raise ValueError(f"{len(caches)} caches but {token_ids.numel()} tokens")
        for i, c in enumerate(caches):
            if c.length >= c.capacity:
                raise FusionError(f"the cache of sequence {i} is full ({c.capacity} tokens)")
            c.finish_loading()
        device = self.tf.embed_tokens.weight.device
        token_ids = token_ids.to(device)
        if self.static and len(caches) <= self.max_batch and all(c.memory is self.memory for c in caches):
            logits = self._static(caches, token_ids)
        else:
            logits = self._eager(caches, token_ids)
        for c in caches:
            c.length += 1
        return logits

    def _eager(self, caches: list[FusedCache], token_ids: torch.Tensor) -> torch.Tensor:
        """Per layer: the batch's projections as one matrix, its K/V written (one index write when the
        caches share a memory), then one attention call per row over its own keys, the query heads of a
        KV head folded into that call's rows so each key is read once per KV head."""
        tf, b = self.tf, len(caches)
        device = token_ids.device
        positions = torch.tensor([c.next_position for c in caches], device=device)
        shared = caches[0].memory if all(c.memory is caches[0].memory for c in caches) else None
        slots = [c.extent.start + c.length for c in caches]  # each row's write slot in its memory
        write = torch.tensor(slots, device=device)
        ranges = _key_ranges(tf, caches)  # window -> per row (first, stop) slot in its memory
        tables = rope_tables(tf, positions)
        hkv, d = tf.num_kv_heads, tf.head_dim
        group = tf.num_heads // hkv
        softcap = getattr(tf, "softcap", None)
        h = tf.embed(token_ids).view(b, 1, -1)
        with _decode_kernels(device):
            for layer in range(tf.num_layers):
                cos, sin = tables[layer]
                q, k, v = tf.project(layer, h, cos, sin)  # [B, H | Hkv, 1, D]
                k_new, v_new = k[:, :, 0].transpose(0, 1), v[:, :, 0].transpose(0, 1)  # [Hkv, B, D]
                if shared is not None:
                    shared.k[layer].index_copy_(1, write, k_new.to(shared.k.dtype))
                    shared.v[layer].index_copy_(1, write, v_new.to(shared.v.dtype))
                q_rows = q.reshape(b, hkv, group, d)
                spans = ranges[_layer_attr(tf, "windows", layer, None)]
                outs = []
                for i, c in enumerate(caches):
                    keys, values = c.memory.k[layer], c.memory.v[layer]  # [Hkv, T, D]
                    if shared is None:
                        keys[:, slots[i]] = k_new[:, i].to(keys.dtype)
                        values[:, slots[i]] = v_new[:, i].to(values.dtype)
                    lo, hi = spans[i]
                    if softcap:  # a model with soft-capped scores: the transformer's own attention
                        outs.append(tf.attend_all(q[i : i + 1], keys[None, :, lo:hi], values[None, :, lo:hi])
                                    .reshape(1, hkv, group, d))
                    else:  # 4-D: the 3-D call takes the math kernel on the CPU, twice as slow
                        outs.append(F.scaled_dot_product_attention(q_rows[i : i + 1], keys[None, :, lo:hi],
                                                                   values[None, :, lo:hi], scale=tf.scale))
                h = tf.finish(layer, h, torch.cat(outs).view(b, tf.num_heads, 1, d))
        return tf.logits(h[:, -1])

    # -- the static path --------------------------------------------------------------------------------------
    def _static(self, caches: list[FusedCache], token_ids: torch.Tensor) -> torch.Tensor:
        b = len(caches)
        rows = next(n for n in buckets(self.max_batch) if n >= b)
        step = self._step(rows)
        scratch = self._scratch.start
        meta = torch.tensor([[c.next_position for c in caches] + [0] * (rows - b),
                             [c.extent.start + c.length for c in caches] + [scratch] * (rows - b),
                             [c.extent.start for c in caches] + [scratch] * (rows - b),
                             [c.length + 1 for c in caches] + [1] * (rows - b)], dtype=torch.long)
        ids = torch.zeros(rows, dtype=torch.long)
        ids[:b] = token_ids.cpu()
        return step.run(ids, meta)[:b]

    def _step(self, rows: int) -> _StaticStep:
        step = self._steps.get(rows)
        if step is None:
            step = self._steps[rows] = _StaticStep(self, rows)
        return step

    def warm_up(self) -> float:
        """Compile (and on CUDA capture) the static step of every batch bucket now, with padding rows
        only, so no request meets a compilation; returns the seconds it took (0 off the static path)."""
        if not self.static:
            return 0.0
        t = time.perf_counter()
        scratch = self._scratch.start
        for rows in buckets(self.max_batch):
            meta = torch.tensor([[0] * rows, [scratch] * rows, [scratch] * rows, [1] * rows], dtype=torch.long)
            with torch.inference_mode():
                self._step(rows).run(torch.zeros(rows, dtype=torch.long), meta)
        self.warmup_s = time.perf_counter() - t
        log.info("decode warm-up: %d batch buckets %s in %.1f s", len(self._steps),
                 "captured as CUDA graphs" if self.use_graphs else "compiled", self.warmup_s)
        return self.warmup_s


def rope_tables(tf, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, cos/sin [B, 1, 1, D] of one row per position; computed once per distinct rotary
    embedding (a model with local and global layers has two)."""
    b = positions.numel()
    by_rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    out = []
    for layer in range(tf.num_layers):
        rope = tf.rope_of(layer) if hasattr(tf, "rope_of") else tf.rope
        if id(rope) not in by_rope:
            by_rope[id(rope)] = tuple(t.view(b, 1, 1, -1) for t in rope.cos_sin(positions, tf.dtype))
        out.append(by_rope[id(rope)])
    return out


def _key_ranges(tf, caches: list[FusedCache]) -> dict[int | None, list[tuple[int, int]]]:
    """Per window size (None: global layers), each row's keys as slots [first, stop) of its memory after
    this step's write: its whole cache, or a sliding-window layer's last `window` keys."""
    windows = {_layer_attr(tf, "windows", i, None) for i in range(tf.num_layers)}
    out: dict[int | None, list[tuple[int, int]]] = {}
    for w in windows:
        rows = []
        for c in caches:
            start, seen = c.extent.start, c.length + 1
            if w is not None and c.position_offset:
                raise FusionError("a sliding-window layer cannot decode over a compacted cache (eviction, sparse)")
            rows.append((start + (0 if w is None else max(0, seen - w)), start + seen))
        out[w] = rows
    return out


def _decode_kernels(device: torch.device):
    """On CUDA no cuDNN attention for decode rows (it plans anew for every key length); elsewhere as is."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class _StaticStep:
    """The static step for `rows` rows: fixed input buffers, refilled in place each step, and FlexAttention
    block-mask tables per window size (0: global layers) over them; on CUDA a captured graph.

    The tables are computed outside the compiled function and passed in as tensors, with each row's key
    range; the block mask is assembled inside from them (inductor's CPU lowering refuses tables computed
    inside the graph, and a mask closure over tensors the graph does not take as inputs would be frozen
    at its first values)."""

    def __init__(self, runner: ModelRunner, rows: int) -> None:
        memory, tf = runner.memory, runner.tf
        device = memory.k.device
        self.runner, self.rows = runner, rows
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.meta = torch.zeros(2, rows, dtype=torch.long, device=device)  # position, write slot
        self.windows = sorted({_layer_attr(tf, "windows", i, None) or 0 for i in range(tf.num_layers)})
        zero = torch.zeros(rows, dtype=torch.long, device=device)
        self.spans = {w: self._tables(zero, zero + 1) for w in self.windows}  # window -> (tables, lo, stop)
        self.graph = None
        self.logits: torch.Tensor | None = None

    def _tables(self, lo: torch.Tensor, stop: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
        from torch.nn.attention.flex_attention import BlockMask

        key_len = self.runner.memory.capacity
        mask = BlockMask.from_kv_blocks(*_block_tables(lo, stop, key_len), BLOCK_SIZE=BLOCK, seq_lengths=(1, key_len))
        tables = (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
                  mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices)
        return tuple(t.clone() for t in tables), lo.clone(), stop.clone()

    def _forward(self) -> torch.Tensor:
        r = self.runner
        return r._kernel(r.tf, r.layers_k, r.layers_v, self.ids, self.meta, self.spans)

    def run(self, ids: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        """ids [rows]; meta [4, rows]: position, write slot, extent start, keys seen after the write."""
        self.ids.copy_(ids)
        self.meta.copy_(meta[:2])
        start, stop = meta[2], meta[2] + meta[3]
        for w in self.windows:
            lo = start if w == 0 else torch.maximum(start, stop - w)
            fresh = self._tables(lo, stop)
            for buf, value in zip((*self.spans[w][0], self.spans[w][1], self.spans[w][2]),
                                  (*fresh[0], fresh[1], fresh[2]), strict=True):
                buf.copy_(value)
        if not self.runner.use_graphs:
            return self._forward()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.logits.clone()  # the graph's output buffer is overwritten by the next replay

    def _capture(self) -> None:
        runner = self.runner
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and run once outside the capture
            self._forward()
        torch.cuda.current_stream().wait_stream(side)
        if runner._graph_memory is None:
            runner._graph_memory = torch.cuda.graph_pool_handle()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=runner._graph_memory, capture_error_mode="thread_local"):
            self.logits = self._forward()


def _block_tables(lo: torch.Tensor, hi: torch.Tensor, key_len: int) -> tuple[torch.Tensor, ...]:
    """FlexAttention's (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) for rows that
    each read keys [lo, hi) [B]: blocks wholly inside are full (no mask evaluated), the edge blocks partial."""
    b, nblk = lo.numel(), key_len // BLOCK
    j = torch.arange(nblk, device=lo.device)[None, :]
    first, last = (lo // BLOCK)[:, None], ((hi - 1) // BLOCK)[:, None]
    full = (j >= ((lo + BLOCK - 1) // BLOCK)[:, None]) & (j < (hi // BLOCK)[:, None])
    partial = (j >= first) & (j <= last) & ~full

    def table(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.sort((~chosen).to(torch.int8), dim=1, stable=True).indices  # chosen blocks first
        return chosen.sum(dim=1).to(torch.int32).view(b, 1, 1), order.to(torch.int32).view(b, 1, 1, nblk)

    return (*table(partial), *table(full))


def _static_forward(tf, layers_k: tuple[torch.Tensor, ...], layers_v: tuple[torch.Tensor, ...], ids: torch.Tensor,
                    meta: torch.Tensor, spans: dict) -> torch.Tensor:
    """The step as a function of tensors: ids [B], meta [2, B] (position, write slot), the memory's K/V of
    each layer [Hkv, T, D] and per window size (0: global) the block-mask tables and each row's key range
    [lo, stop) -> logits [B, vocab] (fp32)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    b, key_len = ids.shape[0], layers_k[0].shape[1]
    positions, write = meta[0], meta[1]
    masks = {}
    for w, (tables, lo, stop) in spans.items():
        def inside(bi, hi_, q_idx, kv_idx, lo=lo, stop=stop):
            return (kv_idx >= lo[bi]) & (kv_idx < stop[bi])

        masks[w] = BlockMask((1, key_len), *tables, BLOCK_SIZE=(BLOCK, BLOCK), mask_mod=inside)
    softcap = getattr(tf, "softcap", None)
    score_mod = None if not softcap else (lambda s, bi, hi_, q, kv: softcap * torch.tanh(s / softcap))
    tables = rope_tables(tf, positions)
    h = tf.embed(ids).view(b, 1, -1)
    for layer in range(tf.num_layers):
        cos, sin = tables[layer]
        q, k, v = tf.project(layer, h, cos, sin)  # [B, H | Hkv, 1, D]
        k_mem, v_mem = layers_k[layer], layers_v[layer]
        k_mem.index_copy_(1, write, k[:, :, 0].transpose(0, 1).to(k_mem.dtype))
        v_mem.index_copy_(1, write, v[:, :, 0].transpose(0, 1).to(v_mem.dtype))
        keys = k_mem.unsqueeze(0).expand(b, -1, -1, -1)
        values = v_mem.unsqueeze(0).expand(b, -1, -1, -1)
        out = flex_attention(q.contiguous(), keys, values, score_mod=score_mod,
                             block_mask=masks[_layer_attr(tf, "windows", layer, None) or 0],
                             scale=tf.scale, enable_gqa=True)
        h = tf.finish(layer, h, out)
    return tf.logits(h[:, -1])
