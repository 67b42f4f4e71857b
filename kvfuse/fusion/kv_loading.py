"""Moving the chunks' stored caches into the fused cache, one layer at a time (CacheBlend's pipeline).

A fused prefill reads layer l of the cache only when it reaches layer l, so nothing forces the whole
context's KV to be in place before the first layer runs. `LayerLoader` moves it a layer at a time, in
the order the prefill reads it:

- on a CUDA device, a thread copies each layer of the chunks on a side stream: each chunk's layer
  straight from page-locked memory (the store decodes into it on a CUDA worker) or device memory into
  its positions of the cache, or else gathered first into a reusable page-locked host buffer (one
  contiguous transfer per layer), casts it to the compute dtype and rotates its keys to their global
  positions there, and records an event per layer. The compute stream waits on that event the first
  time it touches the layer (`FusedCache` calls `wait`), so layer l + 1 arrives while layer l computes;
- on the CPU the same steps run in the same order without a stream or a thread, each layer when it is
  first touched, each chunk's layer cast straight into its positions.

The cache is the request's extent of the engine's KV memory (engine/kv_memory.py), so what is placed
here is where decoding reads it: after the store's read, a value crosses once (the cast into place; on
CUDA from page-locked memory, the transfer into place), a key once plus its rotation (the transfer or
cast into a temporary, the rotation written into place). Only pageable host memory on CUDA adds the
gather into the staging buffer.

Each chunk's layer comes from `ChunkKV.layer_kv`: a chunk stored in a quantized format (kvfuse/
kv_formats.py) is dequantized there a layer at a time, on the device after its codes crossed the bus (a
CUDA worker takes the direct path for it, never the host staging buffers), on the CPU as the layer is
placed; no floating copy of the whole chunk is ever made.

Both do the same arithmetic on the same bytes, so the fused result is identical (tests/fusion/
test_kv_loading.py pins that, and the GPU half of the suite pins it on CUDA). The keys are rotated in
fp32 from the stored dtype and rounded once into the compute dtype.

What it cannot hide: a method's first reads. A probe-based method (`anchor`, `prophetkv`) runs the
question alone through most layers before it selects, and the probe's few rows compute much faster
than a layer's KV crosses the bus, so most of the copy is on its critical path; a check-layer method
(`cacheblend`, `a3`) waits for layer 0 and then recomputes while the rest arrives. `stats()` reports
the copy time and the part of it the compute stream spent waiting (docs/results/gpu/).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from kvfuse.fusion.model.rope import Rope, apply_rope
from kvfuse.fusion.types import ChunkKV

_HOST_SLOTS = 3  # page-locked staging buffers in flight: the host gathers layer l + 2 while l copies


class LayerLoader:
    """Places `chunks` (ChunkKV with KV on any device) at global positions `starts` of `cache`, layer by
    layer; keys rotated from positions 0..n-1 to their place when `recover` (RoPE position recovery),
    each layer by its own rope (`rope`: one for every layer, or one per layer: Gemma 3's local and
    global layers rotate by different bases).

    `start()` begins the transfer; `wait(layer)` makes the caller's stream wait until that layer is in
    place; `finish()` waits for every layer and releases the staging buffers."""

    def __init__(self, cache, rope: Rope | Sequence[Rope], chunks: Sequence[ChunkKV], starts: Sequence[int],
                 recover: bool) -> None:
        self.cache = cache
        self.chunks = [c for c in chunks if len(c)]
        self.first = starts[0] if starts else 0
        self.n = sum(len(c) for c in self.chunks)
        if self.chunks and starts[-1] + len(chunks[-1]) - self.first != self.n:
            raise ValueError("the chunks must be placed back to back")
        self.num_layers = cache.k.shape[0]
        self.device = cache.k.device
        self.recover = recover
        ropes = [rope] * self.num_layers if isinstance(rope, Rope) else list(rope)
        tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if recover and self.n:  # one shift table per distinct rope
            for r in ropes:
                if id(r) not in tables:
                    tables[id(r)] = self._shift_tables(r, chunks, starts)
        self.tables = [tables[id(r)] for r in ropes] if tables else None
        self.offsets = [0]  # each chunk's first row among the context's N
        for c in self.chunks:
            self.offsets.append(self.offsets[-1] + len(c))
        self.source_dtype = self._source_dtype()
        self.cuda = self.device.type == "cuda"
        self._done = -1  # CPU: layers placed so far (in order)
        self._waited: set[int] = set()
        self.copy_s = 0.0  # CPU: time spent placing; CUDA: read from the events in stats()
        self._error: BaseException | None = None
        if self.cuda:
            self.stream = torch.cuda.Stream(self.device)
            self.events = [torch.cuda.Event(enable_timing=True) for _ in range(self.num_layers)]
            self.posted = [threading.Event() for _ in range(self.num_layers)]  # its event is recorded
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.wait_marks: dict[int, torch.cuda.Event] = {}
            self._thread: threading.Thread | None = None

    # -- what the loaded layers hold --------------------------------------------------------------
    def _source_dtype(self) -> torch.dtype:
        """The dtype a layer is gathered in: the chunks' own when they share one (fp32 for quantized
        chunks, which are dequantized in it), else the cache's; fp32 whenever a quantized chunk is among
        mixed ones, so its values are not rounded before the keys are rotated."""
        dtypes = {c.layer_dtype for c in self.chunks}
        if len(dtypes) == 1:
            return dtypes.pop()
        return torch.float32 if any(c.quantized for c in self.chunks) else self.cache.k.dtype

    def _shift_tables(self, rope: Rope, chunks: Sequence[ChunkKV], starts: Sequence[int]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin [N, D]: the pure rotation that takes each context token's key from its position
        inside its chunk to its global position (the chunk's start)."""
        deltas = torch.cat([torch.full((len(c),), s, dtype=torch.long) for c, s in zip(chunks, starts, strict=True)])
        return rope.shift_table(deltas.to(self.device))

    def _gather(self, layer: int, out_k: torch.Tensor | None = None, out_v: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunks' K and V of one layer side by side, [Hkv, N, D] each, in the source dtype: on the
        host into page-locked `out_k`/`out_v` when given, else on the cache's device."""
        device = out_k.device if out_k is not None else self.device
        ks, vs = zip(*(c.layer_kv(layer, device, self.source_dtype) for c in self.chunks), strict=True)
        if out_k is None:
            return torch.cat(ks, dim=1), torch.cat(vs, dim=1)
        return torch.cat(ks, dim=1, out=out_k), torch.cat(vs, dim=1, out=out_v)

    def _place(self, layer: int, k: torch.Tensor, v: torch.Tensor, row: int = 0) -> None:
        """Cast K/V [Hkv, n, D] of context rows row..row+n-1 into the compute dtype at their positions,
        keys rotated in fp32 and rounded once."""
        lo, hi = self.first + row, self.first + row + k.shape[1]
        if self.tables is not None:
            cos, sin = (t[row : row + k.shape[1]] for t in self.tables[layer])
            k = apply_rope(k.float(), cos, sin)
        self.cache.k[layer, :, lo:hi].copy_(k)
        self.cache.v[layer, :, lo:hi].copy_(v)

    def _place_chunks(self, layer: int) -> None:
        """Each chunk's layer straight into its positions (from the host, page-locked memory or the device;
        a quantized chunk's codes dequantized on the way)."""
        for c, row in zip(self.chunks, self.offsets, strict=False):
            self._place(layer, *c.layer_kv(layer, self.device), row)

    # -- the transfer ---------------------------------------------------------------------------------
    def start(self) -> LayerLoader:
        if not self.n:
            self._done = self.num_layers - 1
            if self.cuda:
                for e in self.posted:
                    e.set()
            return self
        if self.cuda:
            self.start_event.record(torch.cuda.current_stream(self.device))
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the cache was allocated there
            # inference mode is per thread: the copies run in the caller's, or they could not write its tensors
            self._inference = torch.is_inference_mode_enabled()
            self._thread = threading.Thread(target=self._copy_all, name="kv-layer-loader", daemon=True)
            self._thread.start()
        return self

    def _copy_all(self) -> None:
        try:
            with torch.inference_mode(self._inference), torch.cuda.stream(self.stream):
                pageable = [c.k.device.type == "cpu" and not (c.k.is_pinned() and c.v.is_pinned())
                            for c in self.chunks]
                if all(pageable) and not any(c.quantized for c in self.chunks):
                    self._copy_from_host()
                else:  # page-locked, in device memory or quantized: each chunk's layer straight to the device
                    for layer in range(self.num_layers):
                        self._place_chunks(layer)
                        self._post(layer)
        except BaseException as err:  # surfaced by wait()
            self._error = err
            for e in self.posted:
                e.set()

    def _copy_from_host(self) -> None:
        hkv, d = self.cache.k.shape[1], self.cache.k.shape[3]
        shape = (hkv, self.n, d)
        slots = [(torch.empty(shape, dtype=self.source_dtype, pin_memory=True),
                  torch.empty(shape, dtype=self.source_dtype, pin_memory=True)) for _ in range(_HOST_SLOTS)]
        freed = [None] * _HOST_SLOTS  # event: the slot's last transfer has finished reading it
        dev_k = torch.empty(shape, dtype=self.source_dtype, device=self.device)
        dev_v = torch.empty(shape, dtype=self.source_dtype, device=self.device)
        for layer in range(self.num_layers):
            s = layer % _HOST_SLOTS
            if freed[s] is not None:
                freed[s].synchronize()
            host_k, host_v = self._gather(layer, *slots[s])
            dev_k.copy_(host_k, non_blocking=True)
            dev_v.copy_(host_v, non_blocking=True)
            freed[s] = torch.cuda.Event()
            freed[s].record(self.stream)
            self._place(layer, dev_k, dev_v)
            self._post(layer)

    def _post(self, layer: int) -> None:
        self.events[layer].record(self.stream)
        self.posted[layer].set()

    def wait(self, layer: int) -> None:
        """Before the caller's stream reads or writes `layer` of the cache."""
        if layer in self._waited:
            return
        if self.cuda:
            self.posted[layer].wait()
            if self._error is not None:
                raise self._error
            stream = torch.cuda.current_stream(self.device)
            mark = torch.cuda.Event(enable_timing=True)
            mark.record(stream)
            self.wait_marks[layer] = mark
            stream.wait_event(self.events[layer])
        else:
            t = time.perf_counter()
            while self._done < layer:
                self._done += 1
                self._place_chunks(self._done)
            self.copy_s += time.perf_counter() - t
        self._waited.add(layer)

    def finish(self) -> None:
        """Every layer in place (for the caller's stream); the thread joined."""
        for layer in range(self.num_layers):
            self.wait(layer)
        if self.cuda and self._thread is not None:
            self._thread.join()

    def stats(self) -> dict[str, float]:
        """copy_s: the whole transfer; exposed_s: how long the compute stream waited on it (on the CPU
        nothing overlaps: all of it). CUDA figures are read from events: call after the prefill synced."""
        if not self.cuda or not self.n:
            return {"kv_copy_s": self.copy_s, "kv_copy_exposed_s": self.copy_s}
        for e in (*self.events, *self.wait_marks.values()):
            e.synchronize()
        base = self.start_event
        done = [base.elapsed_time(e) for e in self.events]
        copy_ms = max(done)
        exposed = 0.0
        for layer, mark in self.wait_marks.items():
            exposed += max(0.0, done[layer] - base.elapsed_time(mark))
        return {"kv_copy_s": copy_ms / 1e3, "kv_copy_exposed_s": min(exposed, copy_ms) / 1e3}
