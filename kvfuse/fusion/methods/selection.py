"""What a token selector sees: the assembled cache, the prompt layout and lazily computed signals.

Signals are computed on demand and memoised, so a selector pays only for what it asks for:
- `check_projections()`: q/k/v of every context and question row at the check layer, from exact
  hidden states (the engine has run the layers before it in full); a check-layer method reuses them
  when the recompute starts (`CheckLayerMethod.recompute_start`);
- `question_attention()`: the question rows' attention onto each context token at the check layer;
- `value_deviation()`: ||V_new - V_cached|| per context token at the check layer;
- `question_probe(layers)`: the question alone run through the layers over the cache as assembled
  (ProphetKV's stage I), with its attention onto the context per layer and head; every probe-based
  method (prophetkv, anchor) reads this one pass;
- `chunk_edges(first, last)`.
All scores are over context tokens, indexed 0..N-1 (the prefix is exact and never selected).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvfuse.fusion.engine.fused_cache import FusedCache
from kvfuse.fusion.methods import scoring
from kvfuse.fusion.model import attention
from kvfuse.fusion.model.transformer import Rows, Transformer
from kvfuse.fusion.types import FusionOptions, Layout


class SelectionContext:
    def __init__(self, tf: Transformer, cache: FusedCache, layout: Layout, ids: torch.Tensor,
                 options: FusionOptions, check_layer: int, make_rows: Callable[[torch.Tensor], Rows], *,
                 alone: Sequence[bool] | None = None) -> None:
        """alone: per chunk, whether its cache was computed as the start of a sequence (None: every
        chunk), i.e. whether it carries a chunk-start attention sink (ChunkKV.after_context)."""
        self.tf = tf
        self.cache = cache
        self.layout = layout
        self.alone = list(alone) if alone is not None else [True] * len(layout.chunk_lens)
        self.ids = ids  # every prompt token id, [T]
        self.options = options
        self.check_layer = check_layer  # the first layer not run in full for every row
        self.make_rows = make_rows  # positions -> Rows
        self.budget = scoring.budget(options.recompute_ratio, layout.context_len)
        device = ids.device
        self.context = slice(layout.context_start, layout.question_start)
        self.question_positions = torch.arange(layout.question_start, layout.total, device=device)
        self._rows_all: Rows | None = None
        self.hidden: torch.Tensor | None = None  # [1, N + Qn, hidden] at the check layer's input
        self._projections: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._probe: tuple[range, torch.Tensor] | None = None  # (layers scored, [len(layers), H, N])
        # What a method measured while selecting that says how safe its fusion is (merged into the
        # prefill's stats): anchor's `evidence_coverage`, the share of the question's evidence votes
        # its selection recomputes.
        self.signals: dict[str, float] = {}

    @property
    def num_context(self) -> int:
        return self.layout.context_len

    def rows_all(self) -> Rows:
        """Every context and question row (positions prefix_len..T-1)."""
        if self._rows_all is None:
            positions = torch.arange(self.layout.context_start, self.layout.total, device=self.ids.device)
            self._rows_all = self.make_rows(positions)
        return self._rows_all

    # -- signals at the check layer ----------------------------------------------------------------
    def check_projections(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [1,H,N+Qn,D], k/v [1,Hkv,N+Qn,D] of all context + question rows at the check layer."""
        if self._projections is None:
            if self.hidden is None:  # check layer 0: its input is the embeddings
                self.hidden = self.tf.embed(self.ids[self.layout.context_start :])
            rows = self.rows_all()
            self._projections = self.tf.project(self.check_layer, self.hidden, *rows.cos_sin(self.check_layer))
        return self._projections

    def question_attention(self) -> torch.Tensor:
        """[H, Qn, N] fp32: each question row's softmax attention onto the context at the check layer.

        Keys are exact at the check layer: the cached prefix plus the freshly projected context and
        question rows (the softmax runs over all keys each question row may see: within its window on a
        sliding-window layer, with the logits soft-capped where the model caps them).
        """
        q, k, _ = self.check_projections()
        p = self.layout.prefix_len
        keys = torch.cat([self.cache.keys(self.check_layer, p), k.to(self.cache.k.dtype)], dim=2)
        qn = self.layout.question_len
        probs = scoring.attention_probs(q[:, :, -qn:], self.question_positions, keys, self.tf.scale,
                                        window=self.tf.windows[self.check_layer], softcap=self.tf.softcap)
        return probs[:, :, self.context]

    def value_deviation(self) -> torch.Tensor:
        """[N] fp32: ||V_new - V_cached|| per context token at the check layer."""
        _, _, v = self.check_projections()
        n = self.num_context
        cached = self.cache.values(self.check_layer, self.layout.question_start)[:, :, self.context]
        return scoring.value_deviation(v[:, :, :n], cached)

    # -- signals from a question-only pass -----------------------------------------------------------
    def question_probe(self, layers: range) -> torch.Tensor:
        """[len(layers), H, N] fp32: per layer of `layers` and per head, the question rows' attention onto
        each context token, averaged over question rows, from a pass of the question alone over the
        cache as assembled.

        The pass stops after `layers`' last layer (later layers cannot change the scores) and scores only
        `layers`: the layers before them run the attention kernel alone. It writes the question's K/V
        into the cache; the recompute that follows overwrites them. A request for layers outside the
        last pass's runs the pass again over both.
        """
        if self._probe is None or not (self._probe[0].start <= layers.start and layers.stop <= self._probe[0].stop):
            scored = layers if self._probe is None else range(min(layers.start, self._probe[0].start),
                                                                   max(layers.stop, self._probe[0].stop))
            self._probe = (scored, self._run_probe(scored))
        scored, probe = self._probe
        return probe[layers.start - scored.start : layers.stop - scored.start]

    def _run_probe(self, scored: range) -> torch.Tensor:
        """The question rows are the last rows of the keys they see: the attention kernel's lower-right
        causal call gives their output and, on the scored layers, the log-sum-exp that turns their
        scores onto the context into probabilities (no softmax over every key, no fp32 copy of K/V). A
        sliding-window layer's rows score only the context keys in their window (the others get 0)."""
        tf, cache, positions = self.tf, self.cache, self.question_positions
        rows = self.make_rows(positions)
        h = tf.embed(self.ids[positions])
        total = self.layout.total
        per_layer = []
        for layer in range(scored.stop):
            q, k, v = tf.project(layer, h, *rows.cos_sin(layer))
            cache.write(layer, positions, k, v)
            keys, values = cache.keys(layer, total), cache.values(layer, total)
            if layer in scored:
                window, softcap = tf.windows[layer], tf.softcap
                out, lse = attention.with_lse(q, keys, values, tf.scale, window=window, softcap=softcap)
                probs = scoring.probs_from_lse(q, keys[:, :, self.context], lse, tf.scale, softcap=softcap,
                                               window=window, q_positions=positions,
                                               key_start=self.layout.context_start)  # [H, Qn, N]
                per_layer.append(probs.mean(dim=1))
            elif layer + 1 < scored.stop:
                out = tf.attend(cache, layer, rows, q)
            if layer + 1 < scored.stop:
                h = tf.finish(layer, h, out)
        return torch.stack(per_layer)

    # -- structure -----------------------------------------------------------------------------------
    def chunk_edges(self, first: int, last: int) -> torch.Tensor:
        return scoring.chunk_edges(self.layout.chunk_lens, first, last, self.ids.device)

    def sink_starts(self, first: int) -> torch.Tensor:
        """The first `first` tokens of each chunk cached alone (those computed after a context have no
        chunk-start sink), as context-relative indices, sorted."""
        return scoring.chunk_edges(self.layout.chunk_lens, first, 0, self.ids.device, only=self.alone)
