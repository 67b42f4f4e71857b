"""kvlink (KVLink, Yang et al.): K trained link tokens after every chunk, computed per query.

The chunk caches are position-recovered as for `pie`, but every chunk is followed by K link slots: the
global layout is [prefix][chunk 1][links 1][chunk 2][links 2]…[question]. The link rows and the question
rows are the only rows computed, through every layer in one pass, each row attending causally by global
position: link n sees the prefix, chunks 1..n and links 1..n-1 (and its own earlier links), nothing after
it; the question sees everything. That is the paper's attention map (§2.3): chunk tokens attend only
within their chunk (their stored caches), link and question tokens to everything before them. With
K = 0 nothing is added and kvlink is `pie`.

The link embeddings come from the artifact `kvfuse train kvlink` trains for the engine's model
(`kvfuse.fusion.methods.kvlink_artifact`), loaded at engine start; a request for kvlink on a model without one is
refused (ValueError: 422) with the command to train it. docs/methods/kvlink.md has the design and results.

Departures from the paper, and why:
- Only the link embeddings are trained; the model's weights stay as they are (the paper fine-tunes the
  whole model with them). The served model is shared by every method and by the stored chunk caches,
  which a fine-tune would invalidate; see docs/methods/kvlink.md for what this costs.
- The prompt keeps kvfuse's own template (system prompt, chunks in the user turn, question after them);
  the paper's KV-START/KV-END tokens are not added (the template's turn markers bound the documents).
- The link table has a fixed number of chunk indices (the artifact's `max_docs`); chunks past it reuse
  the last index's links (the paper's code has 40 indices and no rule for more).
- The link rows are counted as context rows recomputed: `context_tokens` and `recomputed_tokens` of the
  stats include the N·K link slots.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvfuse.fusion.methods import kvlink_artifact
from kvfuse.fusion.methods.base import FusionMethod, register
from kvfuse.fusion.methods.selection import SelectionContext
from kvfuse.fusion.model.transformer import Rows
from kvfuse.fusion.types import ChunkKV, FusionOptions


def artifacts_dir(settings: Any) -> Path:
    configured = settings.fusion.kvlink_dir
    return Path(configured) if configured else kvlink_artifact.PACKAGED_DIR


def link_layout(chunk_lens: list[int], k: int) -> list[int]:
    """Context indices (0-based over chunks + links) of the link slots when K links follow each chunk."""
    out, pos = [], 0
    for n in chunk_lens:
        pos += n
        out.extend(range(pos, pos + k))
        pos += k
    return out


@register
class KVLink(FusionMethod):
    name = "kvlink"

    def __init__(self) -> None:
        self._slots: list[int] = []  # context indices of the link rows
        self._embeddings: torch.Tensor | None = None  # [N * K, hidden], in slot order

    @classmethod
    def load_artifacts(cls, engine: Any, settings: Any) -> None:
        found = kvlink_artifact.find(artifacts_dir(settings), engine.fingerprint)
        if found is not None:
            engine.artifacts[cls.name] = found

    def tokens_per_chunk(self, options: FusionOptions) -> int:
        return int(options.link_tokens)

    def prepare(self, engine: Any, chunks: list[ChunkKV], options: FusionOptions) -> list[ChunkKV]:
        k = int(options.link_tokens)
        if k == 0 or not chunks:
            return chunks
        art = engine.artifacts.get(self.name)
        if art is None:
            raise kvlink_artifact.KVLinkArtifactError(kvlink_artifact.missing_message(engine.fingerprint))
        links = art.embeddings(k, len(chunks))  # [N, K, hidden]
        shape = (engine.num_layers, engine.num_kv_heads, k, engine.head_dim)
        zeros = torch.zeros(shape, dtype=engine.dtype, device=engine.device)
        slot = ChunkKV([int(art.meta.get("placeholder_id", 0))] * k, zeros, zeros)  # its K/V is computed
        self._slots = link_layout([len(c) for c in chunks], k)
        self._embeddings = links.reshape(-1, links.shape[-1]).to(engine.device, engine.dtype)
        return [part for c in chunks for part in (c, slot)]

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        return torch.tensor(self._slots, dtype=torch.long, device=ctx.ids.device)

    def recompute_start(self, ctx: SelectionContext, local: torch.Tensor, rows: Rows) -> tuple[torch.Tensor, int]:
        """Every layer from the embeddings; the link rows (the first rows: `select` returns exactly
        them, sorted) take the trained link embeddings."""
        h = ctx.tf.embed(ctx.ids[rows.positions])
        if self._embeddings is not None:
            h[0, : self._embeddings.shape[0]] = self._embeddings
        return h, 0
