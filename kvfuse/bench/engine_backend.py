"""The in-process benchmark backend: one engine, loaded once, running any method on a benchmark example,
with vanilla's outputs cached on disk as the reference (kvfuse.bench.reference).

Shared by the fidelity, speed and eviction benchmarks and by the studies; the HTTP backend
(http_backend.py) runs the same examples through a live server instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvfuse.bench import agreement
from kvfuse.bench.fidelity import FLOOR, FLOOR_FP8, Outcome, first_token_signals, neutral_swap, split_format
from kvfuse.bench.reference import Reference, ReferenceCache, reference_key
from kvfuse.bench.scoring import score as score_answer
from kvfuse.bench.tasks import Example
from kvfuse.fusion.engine import solo


@dataclass
class GreedyAnswer:
    """One greedy answer: its text, the tokens chosen (the stop token included), every step's
    log-probabilities [tokens, vocab] when kept, TTFT, and the fused prefill it decoded from."""

    text: str
    tokens: list[int]
    steps: Any
    ttft_s: float
    fused: Any

    @property
    def stats(self) -> dict[str, int]:
        return self.fused.stats

    @property
    def first_logits(self) -> Any:
        """The first token's logits (fp32, CPU): what first-token KL compares."""
        return self.fused.logits.detach().float().cpu()

# Where a chunk's KV comes from in the fidelity bench: computed as ingestion computes it
# (store.precompute_context; first use with the recorded context, option (a), is the same KV), or
# FIRST_PROMPT, option (b): kept from the vanilla prefill of another prompt over the same chunks.
FIRST_PROMPT = "first-prompt"
CHUNK_KV_SOURCES = ("ingestion", FIRST_PROMPT)


class EngineBackend:
    """The fusion engine in this process: load once, precompute each example once."""

    def __init__(self, settings: Any, *, max_tokens: int | None, reference_dir: Any = None,
                 chunk_kv: str = "ingestion", answer_prefix: bool = False):
        """max_tokens: answer budget for every example (None: each example's own); reference_dir: where
        vanilla's outputs are kept between runs (None: computed every run, kept nowhere); chunk_kv: where
        each chunk's KV comes from (CHUNK_KV_SOURCES); answer_prefix: continue the answer with the task's
        answer prefix (RULER's), which no request through the service can give: off, the prompt is the one
        the service sends (the worker's `prompt_parts`)."""
        from kvfuse.fusion import FusionEngine, FusionOptions, GenerationOptions

        if chunk_kv not in CHUNK_KV_SOURCES:
            raise ValueError(f"chunk KV from {chunk_kv!r}: choose from {', '.join(CHUNK_KV_SOURCES)}")
        m = settings.model
        self.settings = settings
        self.engine = FusionEngine.from_settings(settings, max_context_tokens=0)
        self._options_cls = FusionOptions
        self.max_tokens = max_tokens
        self.answer_prefix = answer_prefix
        self.gen = GenerationOptions(max_tokens=max_tokens or 32, temperature=0.0, top_p=1.0)
        self.system_prompt = m.system_prompt
        self.prompt_layout = m.prompt_layout  # kvfuse/fusion/prompt.py
        self.references = ReferenceCache(reference_dir) if reference_dir is not None else None
        self.chunk_kv = chunk_kv
        from kvfuse.fusion import chunk_context

        st = settings.store
        self.context_mode = chunk_context.check_mode(st.precompute_context)
        self.context_tokens, self.neighbours = st.precompute_context_tokens, st.precompute_neighbours
        self._embedder: Any = None
        # chunk precompute cost in the context mode (ingest throughput): chunk tokens, seconds
        self.ingest = {"mode": self.context_mode, "chunk_tokens": 0, "context_tokens": 0, "precompute_s": 0.0,
                       "embed_s": 0.0}

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def methods(self) -> list[str]:
        from kvfuse.fusion import available_methods

        return list(available_methods())

    def options(self, method: str, ratio: float | None) -> Any:
        from kvfuse.fusion.types import request_knobs

        # Every knob but method and ratio comes from config.fusion (same defaults as the service).
        base = request_knobs(self.settings.fusion)
        base["method"] = method
        if ratio is not None:
            base["recompute_ratio"] = ratio
        return self._options_cls(**base)

    def question_ids(self, ex: Example, order: list[int] | None = None) -> tuple[list[int], list[int]]:
        """(prefix_ids, question_ids) of the example with its chunks in `order` (default: as they are), as
        the worker builds them for a query (kvfuse/service/worker/sequences.py: the engine's `prompt_parts`
        with the configured system prompt and layout); with `answer_prefix` on, the task's answer prefix
        continues the assistant turn (more question tokens, always recomputed)."""
        names = ex.names()
        if order is not None:
            names = [names[i] for i in order]
        prefix_ids, question_ids = self.engine.prompt_parts(ex.question, self.system_prompt, names,
                                                            self.prompt_layout)
        if self.answer_prefix and ex.answer_prefix:
            question_ids = question_ids + self.engine.tokenize(ex.answer_prefix)
        return prefix_ids, question_ids

    def chunk_ids(self, ex: Example) -> list[list[int]]:
        """Each chunk's token ids as cached and fused: its text's ids in the layout's block, as the
        service's corpus renders a one-chunk document (`Corpus.prompt_blocks`)."""
        from kvfuse.fusion.prompt import block_ids

        tok = self.engine.tokenize
        return [block_ids(tok, tok(c), name, self.prompt_layout) for c, name in zip(ex.chunks, ex.names(), strict=True)]

    def prepare(self, ex: Example) -> Any:
        prefix_ids, question_ids = self.question_ids(ex)
        chunk_ids = self.chunk_ids(ex)
        prefix = self.engine.precompute([prefix_ids])[0]
        contexts = self.contexts(ex, prefix_ids, chunk_ids)
        t = time.perf_counter()
        if self.chunk_kv == FIRST_PROMPT:
            chunks = self.first_prompt_kv(prefix_ids, chunk_ids)
            contexts = [[] for _ in chunk_ids]  # no context of its own: the first prompt's chunks before it
        elif not any(contexts):  # `none` for a tokenizer that adds no BOS
            chunks = self.engine.precompute(chunk_ids)
        else:
            chunks = [self.engine.precompute_after(c, ids) for c, ids in zip(contexts, chunk_ids, strict=True)]
        self.ingest["precompute_s"] += time.perf_counter() - t
        self.ingest["chunk_tokens"] += sum(map(len, chunk_ids))
        self.ingest["context_tokens"] += sum(map(len, contexts))
        return prefix, chunks, question_ids

    def first_prompt_kv(self, prefix_ids: list[int], chunk_ids: list[list[int]]) -> list[Any]:
        """Option (b) of docs/DESIGN.md, "KV when it pays": each chunk's KV as the vanilla prefill of the
        query that first met it cold left it, kept and reused by a later query over the same chunks in
        another order. The first query here has the example's chunks in reverse order (each chunk after
        the system prefix and the chunks that follow it in this prompt); one pass, each chunk's slice
        rotated back to positions 0..n-1 (FusionEngine.precompute_run)."""
        order = list(reversed(range(len(chunk_ids))))
        got = self.engine.precompute_run(list(prefix_ids), [chunk_ids[i] for i in order])
        out: list[Any] = [None] * len(chunk_ids)
        for i, kv in zip(order, got, strict=True):
            out[i] = kv
        return out

    def contexts(self, ex: Example, prefix_ids: list[int], chunk_ids: list[list[int]]) -> list[list[int]]:
        """Each chunk's precompute context in this run's mode, as the service would choose it: the
        single haystack's chunks stand for one document (in their order); in the multi-document layout
        (kvfuse.bench.multidoc) each chunk is a document of its own, so `document` gives it nothing.
        Each starts with the sequence's BOS where the tokenizer adds one (`chunk_context.starting_with`),
        as the service's do."""
        from kvfuse.fusion import chunk_context

        start = chunk_context.sequence_start(self.tokenizer)
        return chunk_context.starting_with(start, self._mode_contexts(ex, prefix_ids, chunk_ids),
                                           self.context_tokens)

    def _mode_contexts(self, ex: Example, prefix_ids: list[int], chunk_ids: list[list[int]]) -> list[list[int]]:
        from kvfuse.fusion import chunk_context

        mode, budget = self.context_mode, self.context_tokens
        if mode in ("document", "document_or_neighbours"):
            # Each document of the multi-document layout is one chunk: nothing of its document before it.
            docs = ([[] for _ in chunk_ids] if ex.corpus is not None
                    else chunk_context.document_contexts(chunk_ids, budget))
            if mode == "document":
                return docs

            def neighbours(rows: list[int]) -> list[list[int]]:
                every = self.neighbour_contexts(ex, chunk_ids)
                return [every[i] for i in rows]

            return chunk_context.fill_empty(docs, neighbours)
        if mode == "prefix":
            return [list(prefix_ids) for _ in chunk_ids]
        if mode == "sink":
            return [chunk_context.sink_context(self.tokenizer) for _ in chunk_ids]
        if mode == "neighbours":
            return self.neighbour_contexts(ex, chunk_ids)
        return [[] for _ in chunk_ids]

    def neighbour_contexts(self, ex: Example, chunk_ids: list[list[int]]) -> list[list[int]]:
        """Every chunk's `neighbours` context: among the example's chunks, or in its corpus when it has
        one (the multi-document layout)."""
        from kvfuse.fusion import chunk_context

        embedder = self.embedder()  # loaded once, outside the timing
        t = time.perf_counter()
        vectors = embedder.embed(list(ex.chunks))
        self.ingest["embed_s"] += time.perf_counter() - t
        if ex.corpus is not None:
            return ex.corpus.neighbour_contexts(ex.sources, chunk_ids, vectors, embedder.embed,
                                                self.engine.tokenize, self.neighbours, self.context_tokens)
        return chunk_context.neighbour_contexts(chunk_ids, vectors, self.neighbours, self.context_tokens)

    def embedder(self) -> Any:
        if self._embedder is None:
            self._embedder = load_embedder(self.settings)
        return self._embedder

    def _outcome(self, ex: Example, method: str, ratio: float | None, text: str, ttft_s: float,
                 context_tokens: int, recomputed_tokens: int) -> Outcome:
        return Outcome(task=ex.task, example_id=ex.id, method=method, ratio=ratio, prediction=text.strip(),
                       score=score_answer(ex.metric, text, ex.answers), ttft_s=ttft_s,
                       context_tokens=context_tokens, recomputed_tokens=recomputed_tokens)

    def run(self, ex: Example, prepared: Any, label: str, ratio: float | None,
            reference: Reference | None = None) -> Outcome | None:
        """One method on one example. Vanilla's outcome carries its Reference (read from the reference
        cache when there); any other method is compared with `reference` when given. The floor (FLOOR)
        is vanilla on the example with two fact-free chunks swapped (None where it has no such pair);
        FLOOR_FP8 vanilla with its documents' KV rounded to fp8. A label `method[format]`
        (fidelity.with_format) runs the method on chunks stored in that KV format."""
        prefix, chunks, question_ids = prepared
        method, kv_format = split_format(label)
        if kv_format is not None:
            chunks = stored_as(chunks, kv_format)
        if method == FLOOR_FP8:
            return self._stored_prefill(ex, prepared, "fp8", ratio, reference)
        if method == FLOOR:
            order = neutral_swap(ex)
            if order is None:
                return None
            swapped = self.question_ids(ex, order)[1] if self.prompt_layout != "plain" else question_ids
            return self._full_prefill(ex, (prefix, [chunks[i] for i in order], swapped), method, ratio, reference)
        if method == "vanilla":
            return self._full_prefill(ex, prepared, method, ratio, None)
        opts = self.options(method, ratio)
        self.ingest_artifacts(opts.method, chunks)  # the method itself (a study may run it under a label)
        budget = self.max_tokens or ex.max_tokens
        ans = self.greedy(prefix, chunks, question_ids, opts, budget)
        out = self._answered(ex, label, ratio, ans)
        if reference is not None and reference.tokens:
            self._compare(out, ans.fused, reference)
        return out

    def _stored_prefill(self, ex: Example, prepared: Any, kv_format: str, ratio: float | None,
                        reference: Reference | None) -> Outcome:
        """Vanilla with its own KV of the documents stored in `kv_format` and read back: the prefix and
        the documents prefilled as vanilla does (one pass, `precompute_after`), the documents' KV stored,
        then the question prefilled over it (`pie`: one chunk, already where vanilla has it, nothing
        recomputed). What the format changes, with no fusion in between."""
        from kvfuse.fusion import ChunkKV

        prefix, chunks, question_ids = prepared
        context = [t for c in chunks for t in c.token_ids]
        whole = self.engine.precompute_after(prefix.token_ids, context)
        stored = stored_as([ChunkKV(context, whole.k, whole.v, after_context=True)], kv_format)
        ans = self.greedy(prefix, stored, question_ids, self.options("pie", None), self.max_tokens or ex.max_tokens)
        out = self._answered(ex, FLOOR_FP8, ratio, ans)
        if reference is not None and reference.tokens:
            self._compare(out, ans.fused, reference)
        return out

    def _answered(self, ex: Example, method: str, ratio: float | None, ans: GreedyAnswer) -> Outcome:
        stats = ans.stats
        out = self._outcome(ex, method, ratio, ans.text, ans.ttft_s, int(stats["context_tokens"]),
                            int(stats["recomputed_tokens"]))
        out.kv_loaded_share, out.fused_cache_tokens = loaded_share_and_cache(
            "vanilla" if method == FLOOR else split_format(method)[0], stats)
        out.first_margin, out.first_entropy = first_token_signals(ans.fused.logits)
        out.evidence_coverage = stats.get("evidence_coverage")
        return out

    def _compare(self, out: Outcome, fused: Any, reference: Reference) -> None:
        """First-token and answer KL against vanilla's answer, teacher-forced on `fused`'s cache."""
        logits = agreement.teacher_forced_logits(self.engine, fused, reference.tokens)
        kls = agreement.token_kls(reference.logprobs, logits)
        out.kl_vs_vanilla, out.answer_kl_vs_vanilla = kls[0], sum(kls) / len(kls)

    def _full_prefill(self, ex: Example, prepared: Any, method: str, ratio: float | None,
                      reference: Reference | None) -> Outcome:
        """Vanilla on `prepared` (the floor: on its swapped chunks), its outputs kept in the reference
        cache. Against `reference` (the floor's case): KL from the kept distributions when the answers
        are the same tokens (they are then the teacher-forced ones), else teacher-forced on a new prefill."""
        prefix, chunks, question_ids = prepared
        budget = self.max_tokens or ex.max_tokens
        key = None
        if self.references is not None:
            key = reference_key(self.engine.fingerprint,
                                [prefix.token_ids, *(c.token_ids for c in chunks), question_ids], budget)
            hit = self.references.load(key)
            if hit is not None and (reference is None or hit.tokens == reference.tokens):
                out = self._outcome(ex, method, ratio, hit.prediction, hit.ttft_s, hit.context_tokens,
                                    hit.recomputed_tokens)
                if reference is None:
                    out.kl_vs_vanilla = out.answer_kl_vs_vanilla = 0.0
                    out.reference = hit
                elif reference.tokens:
                    kls = agreement.token_kls(reference.logprobs, hit.logprobs.float())
                    out.kl_vs_vanilla, out.answer_kl_vs_vanilla = kls[0], sum(kls) / len(kls)
                return out
        ans = self.greedy(prefix, chunks, question_ids, self.options("vanilla", 1.0), budget, keep_steps=True)
        out = self._answered(ex, method, ratio, ans)
        ref = Reference(ans.text.strip(), ans.tokens, ans.steps.half(), ans.ttft_s, out.context_tokens,
                        int(ans.stats["recomputed_tokens"]))
        if key is not None:
            self.references.save(key, ref)
        if reference is None:
            out.reference = ref
            out.kl_vs_vanilla = out.answer_kl_vs_vanilla = 0.0  # the reference itself
        elif reference.tokens:
            self._compare(out, ans.fused, reference)
        return out

    def ingest_artifacts(self, method: str, chunks: Any) -> None:
        """What ingest computes besides the KV, computed before the timed prefill as the service has it
        stored (samkv's per-chunk analysis, memoised by content in this process)."""
        from kvfuse.fusion.methods import get_method

        if get_method(method).own_pipeline:
            from kvfuse.fusion.methods.samkv import artifacts_for
            from kvfuse.fusion.methods.sparse.source import MemorySource

            for c in chunks:
                artifacts_for(self.engine, MemorySource(c))

    def greedy(self, prefix: Any, chunks: Any, question_ids: list[int], opts: Any, max_tokens: int, *,
               keep_steps: bool = False) -> GreedyAnswer:
        """The greedy answer from one fused prefill, decoded by the engine's own loop (`decode_from`, what
        `generate` runs after fusing); TTFT as generate measures it (start of fuse to the first token
        chosen). `keep_steps`: keep every step's log-probabilities (a reference answer's)."""
        import torch

        from kvfuse.fusion.types import GenerationOptions, GenerationResult

        engine = self.engine
        t0 = time.perf_counter()
        fused = engine.fuse(prefix, chunks, question_ids, opts, max_tokens=max_tokens)
        chosen: list[int] = []
        steps: list[Any] = []

        def on_step(logits: Any, token: int) -> None:
            chosen.append(token)
            if keep_steps:
                steps.append(torch.log_softmax(logits.float(), -1))

        result = None
        for item in solo.decode_from(engine, fused, GenerationOptions(max_tokens=max_tokens, temperature=0.0),
                                       started=t0, on_step=on_step):
            if isinstance(item, GenerationResult):
                result = item
        text = engine.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        return GreedyAnswer(text, chosen, torch.stack(steps) if keep_steps else None, result.timings["ttft_s"], fused)

    def finish(self, ex: Example, prepared: Any) -> None:
        return None


def load_embedder(settings: Any) -> Any:
    """The embedder the service retrieves with (`model.embedder`), on the CPU as the API runs it."""
    from kvfuse.model_files import resolve_embedder
    from kvfuse.retriever import Embedder

    return Embedder(resolve_embedder(settings.model.embedder), device="cpu")


def stored_as(chunks: Any, kv_format: str) -> list[Any]:
    """The chunks as a store in `kv_format` would hand them back: cast, or quantized (codes and scales,
    dequantized by the engine's loader layer by layer, as in the service)."""
    from kvfuse.fusion import ChunkKV
    from kvfuse.kv_formats import encode_kv

    return [ChunkKV(c.token_ids, *encode_kv(c.k, c.v, kv_format), after_context=c.after_context) for c in chunks]


def loaded_share_and_cache(method: str, stats: dict) -> tuple[float, int]:
    """(share of the chunks' stored KV bytes the prefill read, fused cache positions) from a prefill's
    stats: a method that reports them (samkv) is taken at its word; vanilla reads no KV; every other
    method reads all of it into a cache of the whole prompt."""
    cache = agreement.prompt_cache_positions(stats)
    if "kv_loaded_bytes" in stats:
        total = stats["kv_total_bytes"]
        return (stats["kv_loaded_bytes"] / total if total else 0.0), cache
    return (0.0 if method == "vanilla" else 1.0), cache
