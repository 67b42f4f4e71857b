"""Where every running sequence's KV lives: one buffer per K and V, allocated once at the budget.

`KVMemory` holds K and V as [layers, kv_heads, capacity, head_dim] each, `capacity` being the configured
budget in tokens (`server.kv_budget_tokens`, less what the device ledger carves beside it: ledger.py),
so the bytes it holds never exceed the budget, whatever the mix of lengths. Bytes kept outside the
buffer (a cached system prompt's) are counted in it as *holds* (`hold`), which no extent may use while
held. A sequence gets one contiguous *extent* of it, [start, start + tokens), sized for its prompt plus
the tokens it may generate, and keeps it from admission to retirement:

- the fused prefill writes into it directly (the chunks' stored KV is placed there by the layer loader,
  recomputed rows overwrite theirs in place), so a request's prefill cache *is* its decode memory and
  nothing is copied when it starts decoding;
- a decode step appends each sequence's token at its own next slot and attends over that sequence's own
  extent (`runner.py`), never over another sequence's length;
- a sequence that needs less after its prefill (eviction, a sparse cache) gives its tail back (`shrink`).

Why extents and not pages: every attention kernel of the prefill (the blocked CPU kernel, SDPA, the
flash and flex kernels) reads a layer's keys as one strided tensor; pages would need a gather of the
whole prompt's keys per layer and phase. Contiguous extents keep those reads copy-free at the price of
fragmentation, which `allocate` repairs by sliding settled extents (sequences past their prefill, whose
bytes no loader thread is writing) towards the start: one copy of each moved sequence, counted in
`moved_tokens`. nano-vllm's block manager pages instead; its kernels read pages natively.

A sequence's view of its extent is fused_cache.py's `FusedCache`. docs/DESIGN.md, "Decoding", says who
allocates what.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvfuse.fusion.errors import FusionError


class ModelShape(Protocol):
    """What the memory needs of a model (kvfuse.fusion.model.transformer.Transformer has it): named here,
    not imported, since the transformer's attention writes into a FusedCache of this memory."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device


def token_bytes_of(tf: ModelShape) -> int:
    """Bytes one token's K and V take across every layer of `tf`, in its dtype."""
    return 2 * tf.num_layers * tf.num_kv_heads * tf.head_dim * torch.empty((), dtype=tf.dtype).element_size()


class MemoryFull(FusionError):
    """No extent of the asked size is free (even after compaction)."""


@dataclass(eq=False)
class Extent:
    """Tokens [start, start + tokens) of a KVMemory held by `owner`. `movable`: its bytes may be moved
    (no prefill or loader is writing them); compaction updates `start` in place."""

    owner: Hashable
    start: int
    tokens: int
    movable: bool = False
    kind: str = "query"  # its holder in the ledger (engine/ledger.py): query, shadow, ingest

    @property
    def stop(self) -> int:
        return self.start + self.tokens


@dataclass(eq=False)
class Hold:
    """`tokens` of a KVMemory's count held by bytes that live outside its buffer (a cached system prompt's
    decoded KV): no extent may use them while held. `reclaim`: called when the memory drops the hold to
    make room for an extent (the holder forgets the entry); None: never dropped but by its holder."""

    kind: str
    tokens: int
    reclaim: Callable[[], None] | None = None


class KVMemory:
    """K/V for `capacity` tokens, [L, Hkv, capacity, D] each, handed out as contiguous extents.

    zeroed: the buffers start as zeros and every token an extent gives back (released, shrunk away, or
    left behind by compaction) is zeroed again; align: every extent starts and ends on a multiple of it.
    Both are for a kernel that reads whole key blocks and masks some, as the static decode path does
    (FlexAttention, 128-key blocks): a masked score still multiplies its value, and 0 x NaN is NaN, so a
    block it reads must hold no NaN but its own sequence's. Aligned to the block, no block holds two
    sequences; zeroed, none holds what a retired one left (docs/DESIGN.md, "Decoding"). Otherwise the
    pages are committed only as sequences use them."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str, *, zeroed: bool = False, align: int = 1) -> None:
        if align < 1 or capacity % align:
            raise ValueError(f"a capacity of {capacity} tokens is not a whole number of {align}-token blocks")
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        make = torch.zeros if zeroed else torch.empty
        self.k = make(shape, dtype=dtype, device=device)
        self.v = make(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.zeroed, self.align = zeroed, align
        self.extents: list[Extent] = []  # sorted by start
        self.holds: OrderedDict[Hashable, Hold] = OrderedDict()  # least recently used first
        self.moved_tokens = 0  # tokens copied by compaction since start
        self.peak_tokens = 0  # the most tokens extents and holds held together since start

    @classmethod
    def for_transformer(cls, tf: ModelShape, capacity: int, *, zeroed: bool = False, align: int = 1) -> KVMemory:
        """Memory shaped for `tf` (kvfuse.fusion.model.transformer.Transformer), in its dtype and device."""
        return cls(tf.num_layers, tf.num_kv_heads, tf.head_dim, capacity, tf.dtype, tf.device,
                   zeroed=zeroed, align=align)

    # -- accounting -------------------------------------------------------------------------------------
    @property
    def token_bytes(self) -> int:
        """Bytes one token takes across every layer, K and V."""
        return 2 * self.k.shape[0] * self.k.shape[1] * self.k.shape[3] * self.k.element_size()

    @property
    def nbytes(self) -> int:
        """What the buffers hold: the budget, allocated once."""
        return self.capacity * self.token_bytes

    @property
    def extent_tokens(self) -> int:
        return sum(e.tokens for e in self.extents)

    @property
    def extent_bytes(self) -> int:
        """Bytes held by extents now (running sequences, shadow checks, an ingestion piece's reservation)."""
        return self.extent_tokens * self.token_bytes

    @property
    def held_tokens(self) -> int:
        return sum(h.tokens for h in self.holds.values())

    @property
    def used_tokens(self) -> int:
        """Tokens held by extents and by holds together: what the budget counts."""
        return self.extent_tokens + self.held_tokens

    @property
    def used_bytes(self) -> int:
        """Bytes held by extents and holds now."""
        return self.used_tokens * self.token_bytes

    def bytes_by_kind(self) -> dict[str, int]:
        """Bytes held now by each holder (the extents' and the holds' kinds)."""
        out: dict[str, int] = {}
        for kind, tokens in [*((e.kind, e.tokens) for e in self.extents), *((h.kind, h.tokens) for h in self.holds.values())]:
            out[kind] = out.get(kind, 0) + tokens * self.token_bytes
        return out

    @property
    def free_tokens(self) -> int:
        return self.capacity - self.used_tokens

    def extent_of(self, owner: Hashable) -> Extent | None:
        return next((e for e in self.extents if e.owner == owner), None)

    # -- extents -----------------------------------------------------------------------------------------
    def can_allocate(self, tokens: int, without: Collection[Hashable] = ()) -> bool:
        """Whether `allocate(tokens)` would succeed now (compacting if it must); `without`: were the
        extents of these owners released first (whether preempting them would make the room)."""
        tokens = self._aligned(tokens)
        kept = [e for e in self.extents if e.owner not in without] if without else self.extents
        if tokens > self.capacity - sum(e.tokens for e in kept) - self._fixed_hold_tokens():
            return False
        return self._hole(tokens, kept) is not None or tokens <= self._compactable_room(kept)

    def allocate(self, owner: Hashable, tokens: int, kind: str = "query") -> Extent:
        """An extent of `tokens` (rounded up to `align`) for `owner` (first fit; settled extents slide down
        when only compaction makes room; reclaimable holds are dropped, oldest first, when the count of
        free tokens is short). Raises MemoryFull when none can be had."""
        if tokens < 1:
            raise ValueError(f"an extent needs at least one token, got {tokens}")
        tokens = self._aligned(tokens)
        if self.extent_of(owner) is not None:
            raise ValueError(f"{owner!r} already holds an extent")
        if tokens > self.capacity - self.extent_tokens - self._fixed_hold_tokens():
            raise MemoryFull(f"no {tokens} contiguous KV tokens free ({self.free_tokens} of {self.capacity} free)")
        self._reclaim(tokens)
        start = self._hole(tokens)
        if start is None and tokens <= self._compactable_room():
            self.compact()
            start = self._hole(tokens)
        if start is None:
            raise MemoryFull(f"no {tokens} contiguous KV tokens free ({self.free_tokens} of {self.capacity} free)")
        extent = Extent(owner, start, tokens, kind=kind)
        self.extents.append(extent)
        self.extents.sort(key=lambda e: e.start)
        self.peak_tokens = max(self.peak_tokens, self.used_tokens)
        return extent

    # -- holds: bytes outside the buffer, counted in it ----------------------------------------------------
    def hold(self, owner: Hashable, nbytes: int, kind: str, reclaim: Callable[[], None] | None = None, *,
             make_room: bool = False) -> bool:
        """Count `nbytes` (rounded up to whole tokens) of `owner`'s, kept outside the buffer, against the
        budget; False (nothing held) when the free tokens are fewer (`make_room`: after dropping reclaimable
        holds, as `allocate` does). A reclaimable hold is dropped when an extent needs its tokens, and
        `reclaim` is called then."""
        if owner in self.holds:
            raise ValueError(f"{owner!r} already holds {self.holds[owner].tokens} tokens")
        tokens = -(-nbytes // self.token_bytes)
        if make_room:
            self._reclaim(tokens)
        if tokens > self.free_tokens:
            return False
        self.holds[owner] = Hold(kind, tokens, reclaim)
        self.peak_tokens = max(self.peak_tokens, self.used_tokens)
        return True

    def unhold(self, owner: Hashable) -> None:
        """`owner`'s hold ends (a no-op when it has none)."""
        self.holds.pop(owner, None)

    def touch(self, owner: Hashable) -> None:
        """`owner`'s hold was used: it is the last to be reclaimed."""
        if owner in self.holds:
            self.holds.move_to_end(owner)

    def _fixed_hold_tokens(self) -> int:
        return sum(h.tokens for h in self.holds.values() if h.reclaim is None)

    def _reclaim(self, tokens: int) -> None:
        """Drop reclaimable holds, least recently used first, until `tokens` are free by count."""
        for owner, h in list(self.holds.items()):
            if tokens <= self.free_tokens:
                return
            if h.reclaim is not None:
                del self.holds[owner]
                h.reclaim()

    def release(self, owner: Hashable) -> None:
        """Free `owner`'s extent (a no-op when it holds none); zeroed, its tokens are cleared."""
        extent = self.extent_of(owner)
        if extent is not None:
            self.extents.remove(extent)
            self._clear(extent.start, extent.stop)

    def shrink(self, owner: Hashable, tokens: int) -> None:
        """Give back the tail of `owner`'s extent past `tokens`."""
        extent = self.extent_of(owner)
        tokens = self._aligned(tokens) if tokens > 0 else tokens
        if extent is not None and 0 < tokens < extent.tokens:
            self._clear(extent.start + tokens, extent.stop)
            extent.tokens = tokens

    def _aligned(self, tokens: int) -> int:
        return -(-tokens // self.align) * self.align

    def _clear(self, start: int, stop: int) -> None:
        """Zero tokens [start, stop) of a zeroed memory: no kernel reading whole blocks meets what they held."""
        if self.zeroed and stop > start:
            self.k[:, :, start:stop].zero_()
            self.v[:, :, start:stop].zero_()

    def settle(self, owner: Hashable) -> None:
        """`owner`'s prefill is complete: compaction may move its extent from now on."""
        extent = self.extent_of(owner)
        if extent is not None:
            extent.movable = True

    def _hole(self, tokens: int, extents: list[Extent] | None = None) -> int | None:
        """The start of the first free run of at least `tokens`, or None."""
        at = 0
        for e in self.extents if extents is None else extents:
            if e.start - at >= tokens:
                return at
            at = max(at, e.stop)
        return at if self.capacity - at >= tokens else None

    def _compactable_room(self, extents: list[Extent] | None = None) -> int:
        """The largest free run compaction could make: movable extents slide down between the pinned
        ones, so the free space between consecutive pinned extents (and the ends) gathers into one run."""
        best, at, moving = 0, 0, 0  # at: where the current stretch between pinned extents begins
        for e in self.extents if extents is None else extents:
            if e.movable:
                moving += e.tokens
                continue
            best, at, moving = max(best, e.start - at - moving), e.stop, 0
        return max(best, self.capacity - at - moving)

    def compact(self) -> None:
        """Slide every movable extent as far down as the extents before it allow (one copy each)."""
        at = 0
        for e in self.extents:
            if e.movable and e.start > at:
                n = e.tokens
                # Overlapping ranges move down: copy through a temporary when they overlap.
                src_k, src_v = self.k[:, :, e.start : e.start + n], self.v[:, :, e.start : e.start + n]
                if at + n > e.start:
                    src_k, src_v = src_k.clone(), src_v.clone()
                self.k[:, :, at : at + n].copy_(src_k)
                self.v[:, :, at : at + n].copy_(src_v)
                self._clear(max(at + n, e.start), e.start + n)  # what the move left behind
                self.moved_tokens += n
                e.start = at
            at = max(at, e.stop)
