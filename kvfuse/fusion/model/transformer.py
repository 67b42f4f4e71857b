"""The decoder layers run over the fused cache, for any subset of query rows.

Why not the model's own forward: the HF attention module appends to its cache and cannot overwrite
rows in the middle, so selective recomputation runs the layers here. Norms, projections, MLP, the
embedding and the rotary module are the model's own; how a family wires them into a layer (where its
norms sit, q/k norms, fused projections) is its entry in kvfuse/fusion/model/families.py, read from
transformers' modeling code of that family. Only attention is written out.

Attention: `Rows` are query rows at sorted global positions; a row attends causally by position over
the fused cache, i.e. row i sees keys 0..positions[i] -- on a sliding-window layer (`windows[layer]`,
a local layer of Gemma 2/3, every layer of Mistral) only keys > positions[i] - window, as transformers'
sliding-window mask. Which kernel does that for which row set (the kernel's causal mask, lower-right
causal for contiguous rows, the blocked CPU kernel, FlexAttention on CUDA, the written-out path for
soft-capped logits, the dense [rows, keys] mask as the reference) is kvfuse/fusion/model/attention.py's
choice, planned once per `Rows` and window size (one phase: the full layers, the probe, the recompute)
and shared by every layer. The context is bounded by the model's positions, not its window.

What decoding reads from here (kvfuse/fusion/engine/runner.py): `windows`, `softcap`, `rope_of(layer)`,
`project`, `attend_all`, `finish`, `embed` and `logits` -- each does every per-family step, so a caller
that runs project -> attention -> finish computes the family.

On CUDA the calls where every row sees every key (`attend_all`: a decode step, the last prompt row)
keep off the cuDNN attention backend: it builds an execution plan for every new key length, which a
decode step (one more key each time) would pay on every step; the flash kernel needs none. The
prefill phases keep it: on long prompts its attention ran about twice as fast as flash
(docs/results/gpu/README.md).

Only the last prompt row feeds the logits, so the model's last layer writes every row's K/V but runs
attention and MLP for the last row alone (`Transformer.layer(..., last_only=True)`).

Departures from transformers, and why: attention is computed by the kernels above (same arithmetic,
another summation order); RoPE is applied by `rope.apply_rope` with the module's own cos/sin (the same
formula, partial rotary included); soft-capped attention (Gemma 2) runs in fp32 where transformers'
eager attention multiplies in the model's dtype (in float32 the two are the same).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvfuse.fusion.engine.fused_cache import FusedCache
from kvfuse.fusion.errors import UnsupportedModelError
from kvfuse.fusion.model import attention_cpu, attention_math, families
from kvfuse.fusion.model.attention import Attention
from kvfuse.fusion.model.rope import Rope, apply_rope

# Every row sees every key (decode): no cuDNN, which plans anew for each key length (module docstring).
_NO_PLAN_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class Rows:
    """Query rows at sorted global positions, with what every layer shares for them: cos/sin per
    distinct rotary embedding (`cos_sin(layer)`), and what the attention paths plan once per window size
    (`planned`; the dense mask by position only if the dense path asks).

    rope: the global rotary embedding; layer_ropes: one per layer where layers differ (Gemma 3), else None."""

    def __init__(self, positions: torch.Tensor, rope: Rope, dtype: torch.dtype,
                 layer_ropes: Sequence[Rope] | None = None) -> None:
        self.positions = positions
        self.dtype = dtype
        self.count = int(positions.numel())
        self.stop = int(positions[-1]) + 1  # keys [0, stop) are all any row reads
        self.contiguous = self.stop - int(positions[0]) == self.count  # the last `count` of the keys
        self._rope = rope
        self._layer_ropes = layer_ropes
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by id(rope)
        self._plans: dict[object, object] = {}  # an attention path's per-phase state, by (path, window)

    def cos_sin(self, layer: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [1, 1, R, rotary dims] of layer `layer`'s rotary embedding (None: the global one),
        computed once per distinct rotary embedding."""
        rope = self._rope if layer is None or self._layer_ropes is None else self._layer_ropes[layer]
        table = self._tables.get(id(rope))
        if table is None:
            table = self._tables[id(rope)] = tuple(t.unsqueeze(1) for t in rope.cos_sin(self.positions, self.dtype))
        return table

    @property
    def cos(self) -> torch.Tensor:
        """The global rotary embedding's cos (a model with one rope per layer type: use `cos_sin(layer)`)."""
        return self.cos_sin()[0]

    @property
    def sin(self) -> torch.Tensor:
        return self.cos_sin()[1]

    def planned(self, key: object, build: Callable[[], object]) -> object:
        """What an attention path planned for these rows under `key` (built on first use)."""
        if key not in self._plans:
            self._plans[key] = build()
        return self._plans[key]

    def forget(self, key: object) -> None:
        self._plans.pop(key, None)

    @property
    def mask(self) -> torch.Tensor | None:
        """The causal mask by position [R, stop], additive in the compute dtype (so the kernel never
        converts it); None for rows 0..stop-1 (the kernel's own causal mask). Built on first use."""
        if self.count == self.stop:
            return None
        return self.planned(("mask", None), lambda: attention_cpu.causal_mask(self.positions, 0, self.stop, self.dtype))

    def mask_for(self, window: int | None) -> tuple[int, torch.Tensor | None]:
        """(lo, mask): the keys [lo, stop) some row sees on a layer with `window`, and the additive mask
        [R, stop - lo] over them (None: the kernel's own causal mask, rows 0..stop-1 on a global layer)."""
        if window is None:
            return 0, self.mask
        lo, hi = attention_math.key_range(int(self.positions[0]), self.stop - 1, window)
        return lo, self.planned(("mask", window), lambda: attention_math.additive(
            attention_math.visible(self.positions, lo, hi, window), self.dtype))


class Transformer:
    """The decoder of a supported family (kvfuse/fusion/model/families.py), run layer by layer on `Rows`.

    attention_block_rows: rows per block of the blocked CPU kernel (0: none); sparse_attention: scattered
    rows through FlexAttention on CUDA (kvfuse/fusion/model/attention.py)."""

    def __init__(self, model: torch.nn.Module, attention_block_rows: int = 0, sparse_attention: bool = True) -> None:
        base = model.model
        self.model = model
        self.config = cfg = model.config
        self.family = families.family_of(cfg)
        self.embed_tokens = base.embed_tokens
        self.layers = list(base.layers)
        self.norm = base.norm
        self.lm_head = model.lm_head
        self.num_layers: int = len(self.layers)
        self.num_heads: int = int(cfg.num_attention_heads)
        self.num_kv_heads: int = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim: int = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads)
        self._check_structure()
        self.scale = float(getattr(self.layers[0].self_attn, "scaling", self.head_dim**-0.5))
        weight = self.embed_tokens.weight
        self.dtype: torch.dtype = weight.dtype
        self.device: torch.device = weight.device
        self.windows: list[int | None] = families.layer_windows(cfg, self.family)
        self.softcap: float | None = (float(cfg.attn_logit_softcapping) if self.family.attn_softcap
                                      and getattr(cfg, "attn_logit_softcapping", None) else None)
        self.final_softcap: float | None = (float(cfg.final_logit_softcapping) if self.family.final_softcap
                                            and getattr(cfg, "final_logit_softcapping", None) else None)
        self._ropes = self._make_ropes(base.rotary_emb, weight.device)
        self.rope = self._ropes[self._global_layer()]
        self.attention = Attention(self.scale, weight.device, attention_block_rows, sparse_attention, self.softcap)

    def _make_ropes(self, rotary_emb: torch.nn.Module, device: torch.device) -> list[Rope]:
        """One Rope per layer, shared between layers of one type (Gemma 3: one per layer type)."""
        types = families.rope_layer_types(self.config)
        if types is None:
            rope = Rope(rotary_emb, self.config, device)
            return [rope] * self.num_layers
        by_type = {t: Rope(rotary_emb, self.config, device, layer_type=t) for t in sorted(set(types))}
        return [by_type[t] for t in types]

    def _global_layer(self) -> int:
        """A layer with no window (the first), whose rope is `rope`; layer 0 when every layer has one."""
        return next((i for i, w in enumerate(self.windows) if w is None), 0)

    def _check_structure(self) -> None:
        fam = self.family
        proj = ("qkv_proj",) if hasattr(self.layers[0].self_attn, "qkv_proj") else ("q_proj", "k_proj", "v_proj")
        norms = ("q_norm", "k_norm") if fam.qk_norm else ()
        for i, layer in enumerate(self.layers):
            missing = [p for p in (*fam.norms, "self_attn", "mlp") if not hasattr(layer, p)]
            missing += [f"self_attn.{p}" for p in (*proj, "o_proj", *norms) if not hasattr(layer.self_attn, p)]
            if missing:
                raise UnsupportedModelError(f"decoder layer {i} lacks {missing}: not a {fam.model_type} layout")
            if not fam.qk_norm and (hasattr(layer.self_attn, "q_norm") or hasattr(layer.self_attn, "k_norm")):
                raise UnsupportedModelError(f"decoder layer {i} has q/k norms, which {fam.model_type} does not")

    # -- per-layer pieces -------------------------------------------------------------------------
    def rope_of(self, layer: int) -> Rope:
        """The rotary embedding of `layer` (Gemma 3: its layer type's; `rope` is the global layers')."""
        return self._ropes[layer]

    @property
    def layer_ropes(self) -> list[Rope] | None:
        """One Rope per layer where layers differ, else None (every layer uses `rope`)."""
        return None if all(r is self.rope for r in self._ropes) else list(self._ropes)

    def rows(self, positions: torch.Tensor) -> Rows:
        """Query rows at sorted global positions, with this model's ropes."""
        return Rows(positions, self.rope, self.dtype, self.layer_ropes)

    def shift_keys_(self, k: torch.Tensor, delta: int) -> None:
        """Rotate keys [L, Hkv, n, D] of every layer by `delta` positions in place, each by its layer's rope."""
        for layer in range(k.shape[0]):
            self._ropes[layer].shift_keys_(k[layer], delta)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [R] -> hidden [1, R, hidden] (the model's embedding module: Gemma's scales by sqrt(hidden))."""
        return self.embed_tokens(ids.view(1, -1))

    def project(self, layer: int, h: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Hidden [B, R, hidden] -> q [B, H, R, D], k/v [B, Hkv, R, D], q and k rotated by cos/sin
        (broadcastable to [B, 1, R, rotary dims]: the rows' positions under this layer's rope)."""
        mod = self.layers[layer]
        attn, fam = mod.self_attn, self.family
        x = mod.input_layernorm(h) if fam.layout != "post" else h
        b, r = h.shape[:2]
        hq, hkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if hasattr(attn, "qkv_proj"):  # Phi-3: one projection, split as transformers splits it
            q, k, v = attn.qkv_proj(x).split([hq, hkv, hkv], dim=-1)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        if fam.qk_norm == "projection":  # OLMo 2: over the whole projection, before the heads
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = q.view(b, r, self.num_heads, self.head_dim)
        k = k.view(b, r, self.num_kv_heads, self.head_dim)
        if fam.qk_norm == "head":  # Qwen3, Gemma 3: per head
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, r, self.num_kv_heads, self.head_dim).transpose(1, 2)
        # In q's dtype: a family whose rotary module returns float32 cos/sin (OLMo 2) rotates in float32 and
        # rounds once, as its modeling code does; the others round cos/sin to the model's dtype first.
        return apply_rope(q, cos, sin).to(q.dtype), apply_rope(k, cos, sin).to(k.dtype), v

    def attend(self, cache: FusedCache, layer: int, rows: Rows, q: torch.Tensor) -> torch.Tensor:
        """Attention of the rows q [1, H, R, D] over the fused cache, each row causally by global
        position (within the layer's window): [1, H, R, D]."""
        return self.attention(q, cache.keys(layer, rows.stop), cache.values(layer, rows.stop), rows,
                              self.windows[layer])

    def attend_all(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Rows q [1, H, R, D] that all see every key of k/v [1, Hkv, T, D]: [1, H, R, D] (the caller
        gives a sliding-window layer only the keys in its window).

        No mask, and the query heads sharing a KV head are folded into the rows of one call, so each
        key is read once per KV head rather than once per query head (a decode step is bound by
        reading the cache)."""
        _, h, r, d = q.shape
        hkv = k.shape[1]
        if self.softcap is not None:
            return attention_math.attend(q, k, v, None, self.scale, softcap=self.softcap)
        if q.device.type == "cuda":
            with sdpa_kernel(_NO_PLAN_BACKENDS):
                out = F.scaled_dot_product_attention(q.reshape(1, hkv, (h // hkv) * r, d), k, v, scale=self.scale)
            return out.reshape(1, h, r, d)
        out = F.scaled_dot_product_attention(q.reshape(1, hkv, (h // hkv) * r, d), k, v, scale=self.scale)
        return out.reshape(1, h, r, d)  # CUDA kernels may return it strided

    def finish(self, layer: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Attention output [B, H, R, D] -> o_proj and the residual, then the MLP and its residual, with
        the family's norms where its layer has them (families.py, `layout`)."""
        mod = self.layers[layer]
        b, _, r, _ = attn_out.shape
        o = mod.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, r, -1))
        layout = self.family.layout
        if layout == "pre":
            h = h + o
            return h + mod.mlp(mod.post_attention_layernorm(h))
        h = h + mod.post_attention_layernorm(o)
        if layout == "sandwich":
            return h + mod.post_feedforward_layernorm(mod.mlp(mod.pre_feedforward_layernorm(h)))
        return h + mod.post_feedforward_layernorm(mod.mlp(h))

    def layer(self, cache: FusedCache, layer: int, h: torch.Tensor, rows: Rows, last_only: bool = False) -> torch.Tensor:
        """One decoder layer for the rows: their K/V written into the cache, then attention + MLP.
        last_only: run attention and MLP for the last row alone (it sees every key up to its position,
        or the last `window` of them)."""
        q, k, v = self.project(layer, h, *rows.cos_sin(layer))
        cache.write(layer, rows.positions, k, v)
        if last_only:
            window = self.windows[layer]
            lo = max(0, rows.stop - window) if window is not None else 0
            keys, values = cache.keys(layer, rows.stop), cache.values(layer, rows.stop)
            out = self.attend_all(q[:, :, -1:], keys[:, :, lo:], values[:, :, lo:])
            return self.finish(layer, h[:, -1:], out)
        return self.finish(layer, h, self.attend(cache, layer, rows, q))

    def run(self, cache: FusedCache, h: torch.Tensor, rows: Rows, layers: range) -> torch.Tensor:
        """Run the rows through `layers`. When they end at the model's last layer only the last row's
        output is computed there (all the logits need): the result is then [1, 1, hidden]."""
        for i in layers:
            h = self.layer(cache, i, h, rows, last_only=i == self.num_layers - 1)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden [B, hidden] -> float32 logits [B, vocab] (soft-capped where the family caps them)."""
        logits = self.lm_head(self.norm(h))
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()
