"""Where a chunk's KV blocks come from at query time, and how many bytes were read.

`samkv` never asks for a whole chunk: it reads the initial and local blocks first (for the probe), then
only the middle blocks it selected. A source counts the bytes each read takes from where the chunk lives
(`loaded_bytes`) against the chunk's whole KV (`total_bytes`), the "loaded share" the benchmarks report.

- `MemorySource`: a ChunkKV already in memory (tests, the benchmarks' warm runs): a read slices it, and
  counts the bytes a store read of those blocks would take.
- `StoreSource`: a chunk in the KV store (the service, the benchmarks' cold runs): a read goes through
  `KVStore.load_blocks`, which copies only those blocks out of LMDB (kvfuse.kvblob.read_blocks); a
  version-1 blob has no blocks and is read whole (counted whole). On a miss or a damaged blob it falls
  back to `fallback()`, a full ChunkKV (the worker rebuilds it from the tokens), counted whole.

A chunk stored in a quantized format (kvfuse/kv_formats.py) is read block by block the same way (its
scales are cut by block too, and checked with them) and each read is dequantized as it arrives; its bytes
count as stored. A quantized chunk in memory is dequantized whole first (`ChunkKV.dequantized`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvfuse.fusion.methods.sparse.artifacts import Artifacts
from kvfuse.fusion.methods.sparse.blocks import Segments
from kvfuse.fusion.types import ChunkKV


class BlockSource:
    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self.seg = Segments(len(token_ids))
        self.loaded_bytes = 0
        self.total_bytes = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    def stored_artifacts(self, expected_config: torch.Tensor) -> Artifacts | None:
        """The artifacts kept with the chunk, None when absent (a version-1 blob) or stale."""
        return None

    def read(self, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [L, Hkv, m, D] of the tokens of `blocks` (sorted), in order."""
        raise NotImplementedError


class MemorySource(BlockSource):
    def __init__(self, chunk: ChunkKV, artifacts: Artifacts | None = None) -> None:
        super().__init__(chunk.token_ids)
        if not chunk.has_kv:
            raise ValueError("samkv needs the chunk's KV (token ids alone were given)")
        self.chunk = chunk.dequantized()
        self.artifacts = artifacts
        self.total_bytes = self.chunk.k.nbytes + self.chunk.v.nbytes

    def stored_artifacts(self, expected_config: torch.Tensor) -> Artifacts | None:
        a = self.artifacts
        return a if a is not None and torch.equal(a.config, expected_config) else None

    def read(self, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(self.seg.token_list(blocks), dtype=torch.long, device=self.chunk.k.device)
        k, v = self.chunk.k.index_select(2, idx), self.chunk.v.index_select(2, idx)
        self.loaded_bytes += k.nbytes + v.nbytes
        return k, v


class StoreSource(BlockSource):
    """store: a kvfuse.store.KVStore (or anything with load_blocks/load_artifacts)."""

    def __init__(self, store: Any, key: str, token_ids: list[int], fallback: Callable[[], ChunkKV]) -> None:
        super().__init__(token_ids)
        self.store, self.key, self.fallback = store, key, fallback
        self._full: MemorySource | None = None
        self._header = None

    def _use_full(self) -> MemorySource:
        if self._full is None:
            self._full = MemorySource(self.fallback())
            self.total_bytes = self._full.total_bytes
            self.loaded_bytes += self._full.total_bytes  # rebuilt or read whole: all of it was needed
            self._full.loaded_bytes = 0
        return self._full

    def stored_artifacts(self, expected_config: torch.Tensor) -> Artifacts | None:
        from kvfuse.kvblob import CorruptBlobError, token_hash

        try:
            header = self.store.load_artifacts(self.key)
        except CorruptBlobError:
            header = None
        if header is None or header.num_tokens != len(self.token_ids) or header.token_hash != token_hash(self.token_ids):
            self._use_full()
            return None
        self._header = header
        self.total_bytes = header.payload_bytes
        return Artifacts.from_tensors(header.artifacts, expected_config)

    def read(self, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        from kvfuse.kvblob import CorruptBlobError

        if self._full is None:
            try:
                got = self.store.load_blocks(self.key, blocks)
            except CorruptBlobError:
                got = None
            if got is not None:
                from kvfuse.kv_formats import dequantize

                (k, v, _), nbytes = got
                self.loaded_bytes += nbytes
                return dequantize(k), dequantize(v)
        full = self._use_full()
        return full.read(blocks)
