"""A sequence's view of its extent in the KV memory (kv_memory.py): the K/V of every layer,
[L, Hkv, capacity, D], filled up to `length`. Standalone caches (a benchmark, a shadow check, training)
own a private `KVMemory` of exactly their size. docs/DESIGN.md, "Decoding", says who allocates what.
"""

from __future__ import annotations

import torch

from kvfuse.fusion.engine.kv_memory import Extent, KVMemory, MemoryFull
from kvfuse.kv_formats import QTensor, dequantize


class FusedCache:
    """A sequence's K/V of every layer, [L, Hkv, capacity, D], filled up to `length`: a view of its
    extent in a KVMemory (`in_memory`), or of a private memory of exactly its size (the constructor).

    Sized for the prompt plus the tokens to generate, so prefill writes and decode appends never copy
    it. Rows are written by position (`write`), as gpt-fast's KVCache.update: recomputed rows overwrite
    their cached K/V in place, decode steps append at `length`.

    `position_offset`: slot i >= the prompt holds the token at position i + offset. It is 0 except after
    eviction (`fusion/eviction.py`) or in a sparse cache (samkv), where the kept prompt tokens keep their
    original, rotated keys in fewer slots and new tokens continue at the next original position.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        memory = KVMemory(num_layers, num_kv_heads, head_dim, max(1, capacity), dtype, device)
        self._bind(memory, memory.allocate(self, max(1, capacity)), capacity)

    @classmethod
    def in_memory(cls, memory: KVMemory, extent: Extent, capacity: int | None = None) -> FusedCache:
        """The first `capacity` tokens (default: all) of `extent` in `memory`, as a cache."""
        cache = cls.__new__(cls)
        cache._bind(memory, extent, extent.tokens if capacity is None else capacity)
        return cache

    def _bind(self, memory: KVMemory, extent: Extent, capacity: int) -> None:
        if capacity > extent.tokens:
            raise MemoryFull(f"a cache of {capacity} tokens does not fit its extent of {extent.tokens}")
        self.memory, self.extent, self.capacity = memory, extent, capacity
        self.length = 0
        self.position_offset = 0
        # While the chunks' stored KV is still arriving (kv_loading.LayerLoader), every access to a layer
        # waits for that layer first; None once every layer is in place.
        self.loader = None

    def fork(self, memory: KVMemory, extent: Extent) -> FusedCache:
        """A copy of this cache (its `length` rows of every layer) in `extent` of `memory`: a row of its
        own for another choice of the same request (n > 1), which decodes without touching this one."""
        twin = FusedCache.in_memory(memory, extent, self.capacity)
        self.finish_loading()
        twin.k[:, :, : self.length].copy_(self.k[:, :, : self.length])
        twin.v[:, :, : self.length].copy_(self.v[:, :, : self.length])
        twin.length, twin.position_offset = self.length, self.position_offset
        return twin

    @property
    def k(self) -> torch.Tensor:
        """[L, Hkv, capacity, D]: a view into the memory (its start may move between decode steps)."""
        start = self.extent.start
        return self.memory.k[:, :, start : start + self.capacity]

    @property
    def v(self) -> torch.Tensor:
        start = self.extent.start
        return self.memory.v[:, :, start : start + self.capacity]

    def layer(self, layer: int) -> None:
        """Wait until `layer` holds the assembled KV (no-op once loading finished)."""
        if self.loader is not None:
            self.loader.wait(layer)

    def finish_loading(self) -> dict[str, float]:
        """Every layer in place; returns the loader's copy timings ({} when nothing was loading)."""
        loader, self.loader = self.loader, None
        if loader is None:
            return {}
        loader.finish()
        return loader.stats()

    @property
    def next_position(self) -> int:
        """The position (for RoPE) of the next token appended."""
        return self.length + self.position_offset

    @property
    def nbytes(self) -> int:
        """Bytes of K and V the cache spans."""
        return self.capacity * self.memory.token_bytes

    def keys(self, layer: int, upto: int | None = None) -> torch.Tensor:
        """[1, Hkv, upto, D] view (no copy)."""
        self.layer(layer)
        return self.k[layer, :, : self.length if upto is None else upto].unsqueeze(0)

    def values(self, layer: int, upto: int | None = None) -> torch.Tensor:
        self.layer(layer)
        return self.v[layer, :, : self.length if upto is None else upto].unsqueeze(0)

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows' K/V [1, Hkv, R, D] at their positions [R] of one layer (in place, cast to the
        cache's dtype)."""
        self.layer(layer)
        self.k[layer].index_copy_(1, positions, k[0].to(self.memory.k.dtype))
        self.v[layer].index_copy_(1, positions, v[0].to(self.memory.v.dtype))

    def place(self, start: int, k: torch.Tensor | QTensor, v: torch.Tensor | QTensor) -> None:
        """Copy (and cast) a [L, Hkv, n, D] slab into positions start..start+n-1 of every layer; a slab
        read back in a quantized format (a stored prefix) is dequantized on the way."""
        kf = dequantize(k, self.memory.k.dtype) if isinstance(k, QTensor) else k
        vf = dequantize(v, self.memory.v.dtype) if isinstance(v, QTensor) else v
        n = kf.shape[2]
        self.k[:, :, start : start + n].copy_(kf)
        self.v[:, :, start : start + n].copy_(vf)
