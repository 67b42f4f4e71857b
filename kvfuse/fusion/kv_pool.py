"""The KV pool the decode step reads: one slot per running sequence, owned by the worker.

Layout: K and V are each one tensor [layers, slots, Hkv, tokens, D]. A sequence's fused prefill cache
(`FusedCache`) is copied into a free slot once, when its prefill is complete (`admit`); from then on the
decode step appends its tokens there, and every running sequence's attention is one call per layer
over the pool (`model_runner.py`). Slots, not pages: on a CPU, attention over a paged layout needs the
pages gathered into one tensor each step (a copy of every sequence's cache, as large as the attention
read itself), while slots are a strided view of the pool with a length mask.

Who owns which slot: the occupied slots are always 0..size-1, in the order `owners` lists them. When a
sequence leaves (`release`: finished, cancelled or failed) the last slot's sequence moves into its hole
(one copy of that sequence's cache), so the step never runs rows for holes and the batch of B rows is
always the pool's first B slots.

Size: `slots` and `tokens` grow on demand (slots to the next power of two, so that a CUDA graph of a
batch-size bucket always has its rows; tokens to the next multiple of `TOKEN_ROUND`) and the buffers
are freed when the pool empties. A grown pool holds slots x its longest sequence, more than the sum of
the sequences' caches when their lengths differ much: the price of one strided view per step.
docs/DESIGN.md, "Decoding".
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from kvfuse.fusion.cache import FusedCache
from kvfuse.fusion.errors import FusionError

TOKEN_ROUND = 256  # token capacity grows in these steps (fewer regrowths and window buckets)


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class KVPool:
    """K/V slots of the running sequences, [L, slots, Hkv, tokens, D] each, filled up to `lengths`."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.owners: list[Hashable] = []  # slot i belongs to owners[i]
        self.lengths: list[int] = []  # tokens held in each slot (the next one is written at this index)
        self.offsets: list[int] = []  # position of slot index i >= the prompt is i + offset (eviction)
        self.limits: list[int] = []  # the most tokens each sequence may hold (its prompt + max_tokens)
        self.generation = 0  # bumped whenever the buffers are replaced (captured graphs hold their addresses)
        self.k = self.v = self._alloc(0, 0)

    @classmethod
    def for_transformer(cls, tf) -> KVPool:
        """A pool shaped for `tf` (kvfuse.fusion.model.transformer.Transformer), in its compute dtype and device."""
        return cls(tf.num_layers, tf.num_kv_heads, tf.head_dim, tf.dtype, tf.embed_tokens.weight.device)

    def _alloc(self, slots: int, tokens: int) -> torch.Tensor:
        """Zeroed, not empty: the step attends over every slot's whole window and masks the positions past
        a slot's length, which get weight 0, and 0 x NaN from uninitialised memory is NaN."""
        shape = (self.num_layers, slots, self.num_kv_heads, tokens, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    # -- state --------------------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Occupied slots (0..size-1)."""
        return len(self.owners)

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @property
    def tokens(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def slot_of(self, owner: Hashable) -> int:
        try:
            return self.owners.index(owner)
        except ValueError:
            raise KeyError(f"{owner!r} holds no slot") from None

    def positions(self) -> list[int]:
        """The position (for RoPE) of each slot's next token."""
        return [n + o for n, o in zip(self.lengths, self.offsets, strict=True)]

    # -- admission and release ----------------------------------------------------------------------------
    def admit(self, owner: Hashable, cache: FusedCache) -> int:
        """Copy a completed prefill's cache into a free slot for `owner`; returns the slot. The cache
        itself is no longer needed afterwards."""
        if owner in self.owners:
            raise ValueError(f"{owner!r} already holds slot {self.owners.index(owner)}")
        cache.finish_loading()
        self.reserve(self.size + 1, cache.capacity)
        slot, n = self.size, cache.length
        self.k[:, slot, :, :n].copy_(cache.k[:, :, :n])
        self.v[:, slot, :, :n].copy_(cache.v[:, :, :n])
        self.owners.append(owner)
        self.lengths.append(n)
        self.offsets.append(cache.position_offset)
        self.limits.append(cache.capacity)
        return slot

    def release(self, owner: Hashable) -> None:
        """Free `owner`'s slot (a no-op when it holds none); the last slot's sequence moves into the hole."""
        if owner not in self.owners:
            return
        slot, last = self.owners.index(owner), self.size - 1
        if slot != last:
            n = self.lengths[last]
            self.k[:, slot, :, :n].copy_(self.k[:, last, :, :n])
            self.v[:, slot, :, :n].copy_(self.v[:, last, :, :n])
            for column in (self.owners, self.lengths, self.offsets, self.limits):
                column[slot] = column[last]
        for column in (self.owners, self.lengths, self.offsets, self.limits):
            column.pop()
        if not self.owners:  # empty: give the memory back
            self.k = self.v = self._alloc(0, 0)
            self.generation += 1

    def reserve(self, slots: int, tokens: int) -> None:
        """Grow the buffers (copying what they hold) to at least `slots` x `tokens`."""
        if slots <= self.slots and tokens <= self.tokens:
            return
        new_slots, new_tokens = max(self.slots, pow2_at_least(slots)), max(self.tokens, round_up(tokens, TOKEN_ROUND))
        k, v = self._alloc(new_slots, new_tokens), self._alloc(new_slots, new_tokens)
        n = self.size
        if n:
            k[:, :n, :, : self.tokens].copy_(self.k[:, :n])
            v[:, :n, :, : self.tokens].copy_(self.v[:, :n])
        self.k, self.v = k, v
        self.generation += 1

    def check_room(self) -> None:
        """Every slot can take one more token (else a FusionError naming the first full one)."""
        for owner, n, limit in zip(self.owners, self.lengths, self.limits, strict=True):
            if n >= limit:
                raise FusionError(f"the cache of sequence {owner!r} is full ({limit} tokens)")

    def advance(self) -> None:
        """One token was appended to every occupied slot."""
        self.lengths = [n + 1 for n in self.lengths]
