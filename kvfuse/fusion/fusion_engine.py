"""FusionEngine: the model with its prefills -- precompute chunk caches at ingestion, fuse them at query
time. Decoding is the engine core's (kvfuse/fusion/engine/): a library caller's one request decodes on a
core of its own (`engine.solo.generate`), so this module names nothing of the core."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch

from kvfuse.config import FusionSettings
from kvfuse.fusion import eviction
from kvfuse.fusion.engine.fused_cache import FusedCache
from kvfuse.fusion.engine.runner import ModelRunner
from kvfuse.fusion.errors import ContextOverflowError
from kvfuse.fusion.kv_loading import LayerLoader
from kvfuse.fusion.layer_pause import LayerPause
from kvfuse.fusion.methods import FusionMethod, get_method
from kvfuse.fusion.methods.selection import SelectionContext
from kvfuse.fusion.model import loading as model_loading
from kvfuse.fusion.model.transformer import Rows, Transformer
from kvfuse.fusion.prompt import prompt_texts, stop_token_ids, template_halves
from kvfuse.fusion.prompt_style import style_of
from kvfuse.fusion.steps import drain
from kvfuse.fusion.types import (
    ChunkKV,
    FusedPrefill,
    FusionOptions,
    Layout,
)

_DEFAULTS = FusionSettings()


class FusionEngine:
    def __init__(self, model: torch.nn.Module, tokenizer, *, dtype: str, max_context_tokens: int = 0,
                 precompute_batch_tokens: int = _DEFAULTS.precompute_batch_tokens,
                 attention_block_rows: int = _DEFAULTS.attention_block_rows,
                 sparse_attention: bool = _DEFAULTS.sparse_attention) -> None:
        self.family = model_loading.check_supported(model.config)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.dtype_name = dtype
        self.dtype = model_loading.torch_dtype(dtype)
        self.device = next(model.parameters()).device
        self.tf = Transformer(model, attention_block_rows, sparse_attention)
        self.runner = ModelRunner(self.tf)  # decodes callers' own caches (the engine core has its own memory)
        self.rope = self.tf.rope
        self.num_layers = self.tf.num_layers
        self.num_kv_heads = self.tf.num_kv_heads
        self.head_dim = self.tf.head_dim
        self.max_context_tokens = model_loading.context_limit(model.config, max_context_tokens)
        bound, why = model_loading.context_bound(model.config)
        self.context_reason = why if bound is not None and bound <= self.max_context_tokens else ""
        self.precompute_batch_tokens = precompute_batch_tokens
        self.attention_block_rows = attention_block_rows
        self.fingerprint = model_loading.fingerprint(model, tokenizer, dtype)
        self.artifacts: dict[str, object] = {}  # trained per-model data of methods, by method (`load_artifacts`)
        self.prompt_style = style_of(tokenizer)  # chat, system text in the user turn, or base (prompt_style.py)
        self.stop_strings = self.prompt_style.stop_strings
        self.stop_token_ids = stop_token_ids(tokenizer, model.generation_config)
        # Phase timings (`FusedPrefill.timings`) after the device drained: on a GPU, work is launched
        # asynchronously and an unsynchronised clock measures the launches. Off by default (each sync
        # stalls the pipeline); `kvfuse bench gpu` turns it on for its split runs.
        self.sync_timings = False
        self._pause: LayerPause | None = None  # pre-hooks that pause a precompute's forward, once one is paused

    @classmethod
    def load(cls, model: str, *, device: str = "cpu", dtype: str = "float32", threads: int = 0,
             max_context_tokens: int = 0, **kwargs) -> FusionEngine:
        """model: a local directory or hub id of a causal LM of a supported family (docs/models.md), loaded
        with the family's attention implementation (families.py: SDPA, or eager for Gemma 2)."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        if threads > 0:
            torch.set_num_threads(threads)
        config = AutoConfig.from_pretrained(model)
        model_loading.check_supported(config)
        tokenizer = AutoTokenizer.from_pretrained(model)
        lm = AutoModelForCausalLM.from_pretrained(
            model, dtype=model_loading.torch_dtype(dtype), attn_implementation=model_loading.attn_implementation(config)
        ).to(device)
        return cls(lm, tokenizer, dtype=dtype, max_context_tokens=max_context_tokens, **kwargs)

    @classmethod
    def from_settings(cls, settings, **overrides) -> FusionEngine:
        """The engine that `settings` (kvfuse.config.Settings) describe: model, device, dtype, threads,
        context limit and the fusion section's engine knobs. With `model.check_on_load` the engine is
        checked against transformers' own forward before it is returned (kvfuse/fusion/model/check.py):
        a model it would compute wrong raises ModelCheckError, naming the layer where the two part. A pass
        is remembered for this model, code and stack (check_cache.py), so a restart does not repeat it."""
        from kvfuse.model_files import resolve_llm

        m, f = settings.model, settings.fusion
        kwargs = dict(device=m.device, dtype=m.dtype, threads=m.threads, max_context_tokens=m.max_context_tokens,
                      precompute_batch_tokens=f.precompute_batch_tokens,
                      attention_block_rows=f.attention_block_rows, sparse_attention=f.sparse_attention)
        engine = cls.load(resolve_llm(m.llm, settings.models_dir), **{**kwargs, **overrides})
        engine.load_artifacts(settings)
        if m.check_on_load:
            from kvfuse.fusion.model.check_cache import check_once

            check_once(engine, settings)
        return engine

    def load_artifacts(self, settings) -> None:
        """Let every method load what it trained for this model (kvlink's link embeddings), once at start."""
        from kvfuse.fusion.methods.base import registry

        for method in registry().values():
            method.load_artifacts(self, settings)

    def _clock(self) -> float:
        if self.sync_timings and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()

    def rows(self, positions: torch.Tensor) -> Rows:
        """Query rows at sorted global positions (cos/sin and causal mask built once for every layer)."""
        return self.tf.rows(positions)

    # -- prompt ---------------------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _template_halves(self, system_prompt: str | None) -> tuple[str, str]:
        return template_halves(self.tokenizer, system_prompt)

    def prompt_parts(self, question: str, system_prompt: str | None, names: list[str] | None = None,
                     layout: str = "plain", history: Sequence[Sequence[str]] = ()) -> tuple[list[int], list[int]]:
        """(prefix_ids, question_ids): the template up to the user's content, and the question text (after
        a conversation's earlier turns, if any) plus the template from the end of the user turn through the
        assistant header. Documents go between (`names` and `layout`: kvfuse/fusion/prompt.py)."""
        before, question_part = prompt_texts(self.tokenizer, question, system_prompt, names, layout, history)
        return self.tokenize(before), self.tokenize(question_part)

    # -- chunk caches -----------------------------------------------------------------------------------
    # Each precompute is also a generator (`*_steps`) that, with `paused`, runs the model's forward a
    # decoder layer per resumption (layer_pause.py): the engine core cuts an ingestion piece that way.
    # Paused or not, it is the same forward: the same KV, byte for byte.
    def precompute(self, chunks: list[list[int]]) -> list[ChunkKV]:
        """Each chunk alone at positions 0..n-1; chunks of similar length batched, right-padded (with a
        causal mask, padding after a chunk cannot change it)."""
        return drain(self.precompute_steps(chunks, paused=False))

    @torch.inference_mode()
    def precompute_steps(self, chunks: list[list[int]], *, paused: bool = True
                         ) -> Generator[None, None, list[ChunkKV]]:
        """`precompute`, yielding after each decoder layer of each batch's forward but the last (`paused`)."""
        out: list[ChunkKV | None] = [None] * len(chunks)
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i]))
        batch: list[int] = []
        for i in order + [-1]:
            full = batch and (i < 0 or (len(batch) + 1) * len(chunks[i]) > self.precompute_batch_tokens)
            if full:
                got = yield from self._precompute_batch([chunks[j] for j in batch], paused)
                for j, kv in zip(batch, got, strict=True):
                    out[j] = kv
                batch = []
            if i >= 0:
                batch.append(i)
        return [kv for kv in out if kv is not None]

    def _precompute_batch(self, chunks: list[list[int]], paused: bool) -> Generator[None, None, list[ChunkKV]]:
        width = max(len(c) for c in chunks)
        if width == 0:
            return [self._empty_chunk() for _ in chunks]
        ids = torch.zeros(len(chunks), width, dtype=torch.long, device=self.device)
        for row, c in enumerate(chunks):
            ids[row, : len(c)] = torch.tensor(c, dtype=torch.long)
        layers = (yield from self._hf_cache_steps(ids, paused)).layers
        return [
            ChunkKV(list(c), torch.stack([layer.keys[row, :, : len(c)] for layer in layers]),
                    torch.stack([layer.values[row, :, : len(c)] for layer in layers]))
            for row, c in enumerate(chunks)
        ]

    def precompute_after(self, context: list[int], chunk: list[int]) -> ChunkKV:
        """The chunk's cache computed after `context` (kvfuse/fusion/chunk_context.py): one prefill of
        context + chunk, only the chunk's K/V kept, its keys rotated back to positions 0..n-1, so it is
        stored and fused like a chunk cached alone. An empty context is `precompute([chunk])`."""
        return drain(self.precompute_run_steps(context, [chunk], paused=False))[0]

    def precompute_run(self, context: list[int], chunks: list[list[int]]) -> list[ChunkKV]:
        """Consecutive chunks in one prefill of context + chunks[0] + chunks[1] + ...: each chunk's K/V
        after the context and the chunks before it, its keys rotated back to positions 0..n-1. Causal
        attention makes chunk i's K/V here those of `precompute_after(context + chunks[:i], chunks[i])`:
        the same tokens at the same positions (equal to rounding in general; docs/DESIGN.md, "KV when it
        pays", says where it is bit for bit). The same pass is a vanilla prefill's KV of each chunk when
        the context is the prompt's prefix."""
        return drain(self.precompute_run_steps(context, chunks, paused=False))

    @torch.inference_mode()
    def precompute_run_steps(self, context: list[int], chunks: list[list[int]], *, paused: bool = True
                             ) -> Generator[None, None, list[ChunkKV]]:
        """`precompute_run` (one chunk: `precompute_after`), yielding after each decoder layer of its
        forward but the last (`paused`)."""
        if not chunks:
            return []
        if len(chunks) == 1 and (not context or not chunks[0]):
            return (yield from self.precompute_steps([chunks[0]], paused=paused))
        ids = torch.tensor([list(context) + [t for c in chunks for t in c]], dtype=torch.long, device=self.device)
        layers = (yield from self._hf_cache_steps(ids, paused)).layers
        out, pos = [], len(context)
        for c in chunks:
            k = torch.stack([layer.keys[0, :, pos : pos + len(c)] for layer in layers]).contiguous()
            v = torch.stack([layer.values[0, :, pos : pos + len(c)] for layer in layers]).contiguous()
            if pos:
                self.tf.shift_keys_(k, -pos)
            out.append(ChunkKV(list(c), k, v, after_context=pos > 0))
            pos += len(c)
        return out

    def _hf_cache(self, ids: torch.Tensor):
        """The model's own forward over `ids` [B, n]: its cache, every layer's K/V of every position. The
        cache is built without the config, so a sliding-window layer keeps all its keys (one built from
        the config keeps only the last window of them) while its mask still applies the window."""
        from transformers import DynamicCache

        return self.model.model(input_ids=ids, use_cache=True, past_key_values=DynamicCache()).past_key_values

    def _hf_cache_steps(self, ids: torch.Tensor, paused: bool) -> Generator[None, None, Any]:
        """`_hf_cache`; with `paused`, on a thread of its own, yielding after every decoder layer but the last."""
        if not paused:
            return self._hf_cache(ids)
        if self._pause is None:
            self._pause = LayerPause(self.model.model.layers)
        return (yield from self._pause.steps(lambda: self._hf_cache(ids)))

    def new_cache(self, capacity: int) -> FusedCache:
        """A cache of its own (outside any engine core's memory) for `capacity` tokens."""
        return FusedCache(self.num_layers, self.num_kv_heads, self.head_dim, capacity, self.dtype, self.device)

    def _empty_chunk(self) -> ChunkKV:
        shape = (self.num_layers, self.num_kv_heads, 0, self.head_dim)
        return ChunkKV([], torch.empty(shape, dtype=self.dtype), torch.empty(shape, dtype=self.dtype))

    # -- fusion -------------------------------------------------------------------------------------------
    def _check_chunk(self, kv: ChunkKV, what: str) -> None:
        if not kv.has_kv:
            raise ValueError(f"{what}: token ids only, no KV (only a full-prefill method can use it)")
        expected = (self.num_layers, self.num_kv_heads, len(kv.token_ids), self.head_dim)
        if tuple(kv.k.shape) != expected or tuple(kv.v.shape) != expected:
            raise ValueError(f"{what}: KV shape {tuple(kv.k.shape)} does not match {expected}")

    def check_context(self, total_tokens: int, max_tokens: int = 0) -> None:
        excess = total_tokens + max_tokens - self.max_context_tokens
        if excess > 0:
            why = f": {self.context_reason}" if self.context_reason else ""
            raise ContextOverflowError(
                f"prompt ({total_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model context "
                f"({self.max_context_tokens}{why}) by {excess} tokens", excess_tokens=excess)

    def fuse(self, prefix: ChunkKV | None, chunks: list[ChunkKV], question_ids: list[int],
             options: FusionOptions | None = None, *, max_tokens: int = 0,
             new_cache: Callable[[int], FusedCache] | None = None) -> FusedPrefill:
        """Assemble the cache of prefix + chunks + question and prefill it with `options.method`.

        The returned cache has room for `max_tokens` generated tokens; the prompt must fit with them.
        `new_cache(capacity)`: where the cache lives (the engine core: the request's extent); by default a
        cache of its own.
        """
        return drain(self.fuse_steps(prefix, chunks, question_ids, options, max_tokens=max_tokens, new_cache=new_cache))

    @torch.inference_mode()
    def fuse_steps(self, prefix: ChunkKV | None, chunks: list[ChunkKV], question_ids: list[int],
                   options: FusionOptions | None = None, *, max_tokens: int = 0,
                   new_cache: Callable[[int], FusedCache] | None = None) -> Generator[int, None, FusedPrefill]:
        """`fuse` as a generator that pauses after every decoder layer it runs, yielding the rows that
        layer ran (the unit of prefill work), and returns the FusedPrefill. The scheduler spreads a long
        prefill over several engine steps this way, so the running streams keep decoding meanwhile.
        Selection and assembly run whole."""
        options = options or FusionOptions()
        method = get_method(options.method)
        method.check_serves(self, options)  # a method that cannot compute this model refuses before any work
        eviction.check_serves(self, options.evict_capacity)
        prefix = prefix if prefix is not None else self._empty_chunk()
        chunks = method.prepare(self, chunks, options)  # hook: kvlink adds its link slots
        if not question_ids:
            raise ValueError("question_ids must not be empty")
        if method.own_pipeline:  # a method that builds its own cache (samkv: a sparse one)
            return (yield from method.pipeline(self, prefix, chunks, question_ids, options, max_tokens,
                                               new_cache or self.new_cache))
        if not method.full_prefill:  # a full prefill reads only the token ids
            for i, kv in enumerate([prefix, *chunks]):
                self._check_chunk(kv, "prefix" if i == 0 else f"chunk {i - 1}")
        layout = Layout(len(prefix), [len(c) for c in chunks], len(question_ids))
        self.check_context(layout.total, max_tokens)
        ids = torch.tensor(prefix.token_ids + [t for c in chunks for t in c.token_ids] + list(question_ids),
                           dtype=torch.long, device=self.device)
        cache = (new_cache or self.new_cache)(layout.total + max_tokens)
        timings = {"assemble_s": 0.0, "select_s": 0.0, "recompute_s": 0.0}
        n, p = layout.context_len, layout.prefix_len

        t = self._clock()
        signals: dict[str, float] = {}
        if method.full_prefill:
            rows = self.rows(torch.arange(layout.total, device=self.device))
            h = yield from self._layers(cache, self.tf.embed(ids), rows, range(self.num_layers))
            selected_ctx = torch.arange(n, device=self.device)
            timings["recompute_s"] = self._clock() - t
            full_layers = self.num_layers
        else:
            self._assemble(cache, prefix, chunks, layout, method.recover_positions)
            timings["assemble_s"] = self._clock() - t
            full_layers = method.full_layers(options, self.num_layers)
            if not 0 <= full_layers < self.num_layers:
                raise ValueError(f"check_layer must be in [0, {self.num_layers - 1}], got {full_layers}")
            ctx = SelectionContext(self.tf, cache, layout, ids, options, full_layers, self.rows,
                                   alone=[not c.after_context for c in chunks])
            t = self._clock()
            if full_layers > 0:
                ctx.hidden = yield from self._layers(cache, self.tf.embed(ids[p:]), ctx.rows_all(), range(full_layers))
            t_full = self._clock() - t
            t = self._clock()
            if n == 0:  # nothing to select from
                selected_ctx = torch.empty(0, dtype=torch.long, device=self.device)
            else:
                selected_ctx = torch.unique(method.select(ctx).to(self.device))  # sorted, unique
            if selected_ctx.numel() and (int(selected_ctx[0]) < 0 or int(selected_ctx[-1]) >= n):
                raise ValueError(f"{options.method}: selected indices outside the context [0, {n})")
            timings["select_s"] = self._clock() - t
            t = self._clock()
            h = yield from self._recompute(method, ctx, selected_ctx)
            timings["recompute_s"] = t_full + self._clock() - t
            timings["full_layers_s"] = t_full
            signals = ctx.signals
        cache.length = layout.total
        timings.update(cache.finish_loading())
        logits = self.tf.logits(h[:, -1])[0]
        stats = {
            "prefix_tokens": p, "context_tokens": n, "question_tokens": layout.question_len,
            "recomputed_tokens": int(selected_ctx.numel()), "full_layers": full_layers, **signals,
        }
        fused = FusedPrefill(cache, logits, selected_ctx + p, stats, timings)
        return (yield from self.evict_after_prefill(fused, layout, ids[layout.question_start:], options))

    def evict_after_prefill(self, fused: FusedPrefill, layout: Layout, question_ids: torch.Tensor,
                            options: FusionOptions) -> Generator[int, None, FusedPrefill]:
        """The hook after any method's prefill: SnapKV eviction down to `options.evict_capacity` tokens
        (A³'s extension, fusion/eviction.py); the prefill unchanged when it is 0."""
        return (yield from eviction.evict_steps(self, fused, layout, question_ids, options.evict_capacity))

    def _assemble(self, cache: FusedCache, prefix: ChunkKV, chunks: list[ChunkKV], layout: Layout,
                  recover: bool) -> None:
        """The prefix copied into place now; the chunks' caches start moving in layer by layer
        (kv_loading.LayerLoader: on a GPU behind the compute, each layer cast to the compute dtype and
        its keys rotated to their global positions on the way in). Any access to a layer waits for it."""
        cache.place(0, prefix.k, prefix.v)
        cache.loader = LayerLoader(cache, self.tf.layer_ropes or self.rope, chunks, layout.chunk_starts(),
                                   recover).start()

    def _layers(self, cache: FusedCache, h: torch.Tensor, rows: Rows, layers: range
                ) -> Generator[int, None, torch.Tensor]:
        """`Transformer.run` a layer at a time, yielding the rows run after each; returns the hidden."""
        for i in layers:
            h = self.tf.run(cache, h, rows, range(i, i + 1))
            yield rows.count
        return h

    def _recompute(self, method: FusionMethod, ctx: SelectionContext, selected_ctx: torch.Tensor
                   ) -> Generator[int, None, torch.Tensor]:
        """Recompute the selected context rows + every question row through the layers after the full
        ones (from where `method.recompute_start` says); returns their hidden."""
        n = ctx.layout.context_len
        local = torch.cat([selected_ctx, torch.arange(n, n + ctx.layout.question_len, device=self.device)])
        rows = self.rows(local + ctx.layout.prefix_len)
        h, start = method.recompute_start(ctx, local, rows)
        return (yield from self._layers(ctx.cache, h, rows, range(start, self.num_layers)))

    # -- decoding ---------------------------------------------------------------------------------------------
    def decode_step(self, cache: FusedCache, token_id: int) -> torch.Tensor:
        """Append one token at the cache's next position; returns the next-token logits [vocab] (fp32)."""
        return self.decode_batch([cache], torch.tensor([token_id]))[0]

    def decode_batch(self, caches: list[FusedCache], token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [B], one per cache, each appended at its cache's next position -> next-token logits
        [B, vocab] (fp32): the runner's step (engine/runner.py), the one every decode goes through."""
        return self.runner.decode(caches, token_ids)
