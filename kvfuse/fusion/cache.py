"""The fused cache: one preallocated buffer per K and V holding the prompt and the generated tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Layout:
    """Where each part of the prompt sits (global positions)."""

    prefix_len: int
    chunk_lens: list[int]
    question_len: int

    @property
    def context_start(self) -> int:
        return self.prefix_len

    @property
    def context_len(self) -> int:
        return sum(self.chunk_lens)

    @property
    def question_start(self) -> int:
        return self.prefix_len + self.context_len

    @property
    def total(self) -> int:
        return self.question_start + self.question_len

    def chunk_starts(self) -> list[int]:
        """Global start of each chunk."""
        starts, pos = [], self.prefix_len
        for n in self.chunk_lens:
            starts.append(pos)
            pos += n
        return starts


class FusedCache:
    """K/V of every layer, [L, Hkv, capacity, D], filled up to `length`.

    Sized for the prompt plus the tokens to generate, so prefill writes and decode appends never copy
    it. Rows are written by position (`write`), as gpt-fast's KVCache.update: recomputed rows overwrite
    their cached K/V in place, decode steps append at `length`.

    `position_offset`: slot i >= the prompt holds the token at position i + offset. It is 0 except after
    eviction (`fusion/eviction.py`), where the kept prompt tokens keep their original, rotated keys in
    fewer slots and new tokens continue at the next original position (`next_position`).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.length = 0
        self.position_offset = 0
        # While the chunks' stored KV is still arriving (kv_loading.LayerLoader), every access to a layer
        # waits for that layer first; None once every layer is in place.
        self.loader = None

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
        """Bytes held by K and V (the whole preallocated buffer)."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

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
        self.k[layer].index_copy_(1, positions, k[0].to(self.k.dtype))
        self.v[layer].index_copy_(1, positions, v[0].to(self.v.dtype))

    def clone(self) -> FusedCache:
        """An independent copy (every layer in place first): another sequence decoding from this prompt."""
        self.finish_loading()
        twin = FusedCache.__new__(FusedCache)
        twin.k, twin.v = self.k.clone(), self.v.clone()
        twin.length, twin.position_offset, twin.loader = self.length, self.position_offset, None
        return twin

    def place(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy (and cast) a [L, Hkv, n, D] slab into positions start..start+n-1 of every layer."""
        n = k.shape[2]
        self.k[:, :, start : start + n].copy_(k)
        self.v[:, :, start : start + n].copy_(v)
