"""The sections of the settings (`server`, `model`, `store`, ...), one pydantic model each.

Each field's description is the reference text of docs/configuration.md (`kvfuse config docs`);
`kvfuse.config` puts the sections together into `Settings` and loads them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import NoDecode

FusionMethodName = str  # checked against the fusion registry by the service's create_app, before anything loads


def string_list(v: Any) -> Any:
    """A list setting given as one string (an environment variable): a JSON list (`["a", "b"]`, what
    other tools write) or comma-separated items (`a, b`, friendlier in an env file). Either way the items
    are what was meant, never the brackets and quotes of a JSON list taken as one item."""
    if not isinstance(v, str):
        return v
    if v.strip().startswith("["):
        try:
            items = json.loads(v)
        except json.JSONDecodeError as err:
            raise ValueError(f"starts with '[' but is not a JSON list ({err}); or give comma-separated items"
                             ) from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ValueError("must be a JSON list of strings, or comma-separated items")
        return [i.strip() for i in items if i.strip()]
    return [i.strip() for i in v.split(",") if i.strip()]


# The collection of a document ingested without one. A name, not a setting: stored documents carry it.
DEFAULT_COLLECTION = "default"


class Section(BaseModel):
    """A settings section: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid")


class ModelSettings(Section):
    """The LLM and the embedder: which models, on which device, in which compute dtype."""

    llm: str = Field("default", description=(
        '"default" = SmolLM2-135M-Instruct (offline copy), or a local/hub path'))
    device: str = Field("cpu", description="cpu | cuda | cuda:N")
    dtype: Literal["float32", "float16", "bfloat16"] = Field("float32", description=(
        "float32 | float16 | bfloat16 (compute dtype of the LLM)"))
    threads: int = Field(0, ge=0, description="torch CPU threads in the worker; 0 = torch default")
    max_context_tokens: int = Field(0, ge=0, description=(
        "0 = the model's own limit (max_position_embeddings, or LongRoPE's original length; docs/models.md)"))
    check_on_load: bool = Field(True, description=(
        "before serving, compare the engine's prefill, decode and fused prefills of a short canned prompt with "
        "transformers' forward; a mismatch refuses to start, naming the layer (docs/models.md)"))
    system_prompt: str = Field(
        "You are a helpful assistant. Answer the question using the documents. Answer briefly.",
        description="default system prompt")
    served_model_name: str = Field("", description=(
        'the `model` OpenAI clients name, listed first by /v1/models; "" = the LLM\'s full id '
        '(HuggingFaceTB/SmolLM2-135M-Instruct for "default"; a local folder\'s own name: the one `kvfuse '
        'models prepare` recorded, its config\'s hub id or its model card\'s; else model.llm as given); the '
        'short name and '
        '"kvfuse" are accepted too'))
    prompt_layout: Literal["plain", "labelled"] = Field("plain", description=(
        "how retrieved chunks are rendered: plain (texts run together) | labelled (each a block with its "
        "document's title and a blank line, numbered [n] before the question; docs/DESIGN.md, \"The prompt\")"))
    prompt_order: Literal["best-first", "best-last"] = Field("best-last", description=(
        "where retrieved chunks go: best-first (the top hit first) | best-last (the top hit next to the "
        "question); documents named in a query keep the caller's order"))
    embedder: str = Field("default", description=(
        '"default" = all-MiniLM-L6-v2 (offline copy), or a sentence-transformers path'))
    embed_batch_size: int = Field(32, ge=1, description="chunks embedded per batch")
    devices: Annotated[list[str], NoDecode] = Field([], description=(
        "with server.workers > 1: one local worker per device in turn, e.g. [cuda:0, cuda:1] (env: "
        "comma-separated or a JSON list); empty = all on model.device"))

    @field_validator("devices", mode="before")
    @classmethod
    def _split_devices(cls, v: Any) -> Any:
        return [cls._device(d) for d in string_list(v)]

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v == "cpu" or v == "cuda" or (v.startswith("cuda:") and v[5:].isdigit()):
            return v
        raise ValueError("must be cpu, cuda or cuda:N")


class StoreSettings(Section):
    """The chunk KV store: LMDB (the source of truth), the RAM hot tier in front of it, the Redis index, and
    what each chunk's KV is computed after at ingestion."""

    kv_dtype: Literal["float16", "bfloat16", "float32", "fp8", "int8", "int4"] = Field("int8", description=(
        "format of chunk KV at rest: int8 (a scale per token and head: 0.52x float16's bytes, answers as "
        "float16 storage does) | int4 (KIVI: keys per channel, values per token: 0.30x) | fp8 (e4m3, 0.52x) | "
        "float16 | bfloat16 | float32; new chunks are stored in it, chunks stored in another format are still "
        "read (`kvfuse store convert` rewrites them; docs/results/kv-formats/README.md)"))
    lmdb_map_size_mb: int = Field(1024, ge=1, description=(
        "initial LMDB map size; it grows instead of failing"))
    lmdb_max_readers: int = Field(256, ge=1, description="concurrent LMDB read transactions")
    lmdb_budget_mb: int = Field(0, ge=0, description=(
        "most chunk KV a host's LMDB holds; past it chunks are evicted by store.eviction_policy (texts, "
        "records, embeddings and the index never are; an evicted chunk is rebuilt from its token ids or read "
        'from a lower tier). 0 = no limit (docs/DESIGN.md, "Bounded tiers")'))
    eviction_policy: Literal["lru", "lfu", "s3fifo", "cost"] = Field("s3fifo", description=(
        "which chunks the LMDB budget gives up first: lru | lfu | s3fifo | cost (GreedyDual-Size-Frequency "
        "over recompute seconds); chosen by `kvfuse bench tiers` (docs/results/tiers/README.md). The shared "
        "Redis tier always runs s3fifo"))
    hot_tier_mb: int = Field(512, ge=0, description="RAM LRU of decoded chunk KV in front of LMDB; 0 = off")
    device_tier_mb: int = Field(0, ge=0, description=(
        "LRU of chunk KV kept on model.device (GPU memory on a CUDA worker) above the RAM tier, its budget "
        "carved from the worker's device KV budget (server.kv_budget_tokens); local workers sharing a device "
        "split it as they split that budget; 0 = off"))
    read_threads: int = Field(4, ge=1, description=(
        "threads reading a query's chunk KV from LMDB at once (copy and checksum release the GIL)"))
    redis_namespace: str = Field("kvfuse", min_length=1, description="key prefix for every Redis key")
    rebuild_index_on_empty: bool = Field(True, description=(
        "rebuild the Redis index from LMDB when Redis comes up empty"))
    redis_timeout_s: float = Field(5.0, gt=0, description=(
        "Redis connect/read timeout; past it the index counts as unavailable"))
    reload_policy: bool = Field(True, description=(
        "per query, recompute a chunk's KV instead of reading it when its tier's measured bandwidth makes "
        "reading slower than the engine's measured precompute (docs/DESIGN.md, \"Reload or recompute\")"))
    reload_ewma_weight: float = Field(0.2, gt=0, le=1, description=(
        "weight of each new read or precompute in the measured rates' moving averages"))
    reload_probe_every: int = Field(20, ge=0, description=(
        "a tier the reload policy judged slower than recomputing is read anyway every this many queries "
        "that judged it so, to measure it again (0 = never)"))
    verify_checksums: bool = Field(True, description=(
        "verify each blob's checksum when it is read from LMDB (hot-tier hits skip it)"))
    orphan_grace_s: float = Field(3600.0, ge=0, description=(
        "`kvfuse store check --repair` keeps unreferenced blobs younger than this"))
    # What a chunk's KV is computed after (kvfuse/fusion/chunk_context.py, where the modes are explained);
    # the context's tokens are part of the chunk key. Budget and neighbour count for those modes.
    precompute_context: Literal["none", "document", "neighbours", "prefix", "sink", "document_or_neighbours"] = Field(
        "document_or_neighbours", description=(
            "what a chunk's KV is computed after, at ingestion: none | document | neighbours | prefix | sink | "
            "document_or_neighbours (its document's text before it, or its neighbours where there is none); "
            "each starts with the BOS where the model's tokenizer adds one (Gemma's), none included "
            '(docs/DESIGN.md, "Context-carrying chunk caches")'))
    precompute_context_tokens: int = Field(1024, ge=0, description=(
        "token budget of that context (document, neighbours)"))
    precompute_neighbours: int = Field(2, ge=1, description=(
        "neighbours modes: the chunk's n most similar chunks"))
    precompute_at: Literal["ingest", "first_use"] = Field("ingest", description=(
        "when a chunk's KV is computed: ingest (every chunk before its document is ready) | first_use (a "
        "document is ready once its text, chunks, embeddings and keyword index are stored; each chunk's KV "
        "is computed, after the context recorded for it, the first time a query needs it, and kept); a "
        'request may set it for its documents (docs/DESIGN.md, "KV when it pays")'))
    precompute_runs: bool = Field(False, description=(
        "compute consecutive chunks whose contexts start at the same token (a document's chunks while the "
        "context budget reaches its start) in one prefill instead of one each: fewer tokens at ingestion and "
        "on a query's cold chunks, the same KV only to rounding (kernels depend on the pass's length), so a "
        "chunk computed at first use is no longer eager ingestion's byte for byte (docs/DESIGN.md, \"KV when "
        'it pays")'))


class RetrievalRequestSettings(Section):
    """The retrieval knobs a request may set (`retrieval` on /v1/query and /v1/chat/completions), declared
    once: the request schema is derived from these fields (names, defaults, bounds)."""

    # dense: FAISS over chunk embeddings; keyword: BM25 over chunk terms; hybrid: both, fused by
    # reciprocal rank (docs/DESIGN.md, "Retrieval"; measured in docs/results/retriever/).
    mode: Literal["dense", "keyword", "hybrid"] = Field("hybrid", description=(
        "default retrieval per request: dense (FAISS) | keyword (BM25) | hybrid (both, reciprocal rank "
        "fusion)"))
    rrf_k: int = Field(60, ge=1, description=(
        "hybrid: a chunk scores sum(1 / (rrf_k + rank)) over the dense and keyword lists"))
    candidates: int = Field(50, ge=1, description=(
        "hybrid: how deep each list is read before fusing (at least top_k)"))


class RetrieverSettings(RetrievalRequestSettings):
    """Chunking and retrieval: chunk size, top-k, the FAISS index (flat or HNSW), the BM25 keyword index."""

    chunk_tokens: int = Field(512, ge=16, description=(
        "max LLM tokens per chunk (cut on sentence/paragraph boundaries)"))
    top_k: int = Field(4, ge=1, description="chunks retrieved per query by default")
    max_top_k: int = Field(64, ge=1, description="larger top_k is refused with 422")
    index_type: Literal["flat", "hnsw"] = Field("flat", description=(
        "flat (exact inner product) | hnsw (approximate, large corpora)"))
    hnsw_m: int = Field(32, ge=4, description="HNSW graph degree")
    hnsw_ef_construction: int = Field(200, ge=8, description="HNSW build-time candidate list")
    hnsw_ef_search: int = Field(128, ge=8, description="HNSW query-time candidate list")
    hnsw_compact_ratio: float = Field(0.25, gt=0.0, le=1.0, description=(
        "HNSW cannot delete: removed vectors are skipped until they exceed this share, then it is rebuilt"))
    bm25_k1: float = Field(1.5, gt=0.0, description="BM25 term-frequency saturation")
    bm25_b: float = Field(0.75, ge=0.0, le=1.0, description="BM25 length normalisation")
    # The keyword index's base segment is rebuilt once fresh + removed chunks pass this share of it (and
    # this many chunks): kvfuse/retriever/keyword_segments.py.
    keyword_merge_ratio: float = Field(0.1, gt=0.0, le=1.0, description=(
        "the keyword index is rebuilt once chunks added or removed since its last build pass this share of "
        "it"))
    keyword_merge_min_chunks: int = Field(256, ge=0, description=(
        "... and this many chunks (a smaller index is all fresh rows, scored without a build)"))


class FusionRequestSettings(Section):
    """The fusion knobs a request may set, declared once: the HTTP request's `fusion` object is derived
    from these fields (names, defaults, bounds), and `kvfuse.fusion.FusionOptions` types the same names
    with these defaults (tests/fusion/test_fusion_options.py keeps them in step)."""

    method: FusionMethodName = Field("anchor", description=(
        "default method when a request names none (docs/methods/anchor.md)"))
    recompute_ratio: float = Field(0.15, ge=0.0, le=1.0, description="share of context tokens recomputed")
    check_layer: int = Field(1, ge=0, description="layer whose signal selects tokens (a3, cacheblend)")
    smooth_window: int = Field(5, ge=1, description="a3 score smoothing: average-pool width")
    edge_tokens: int = Field(16, ge=0, description="epic: tokens recomputed at the start of each chunk")
    edge_tokens_end: int = Field(16, ge=0, description="epic: tokens recomputed at the end of each chunk")
    anchor_tokens: int = Field(16, ge=0, description=(
        "anchor: first tokens of each chunk always recomputed (their sink states)"))
    # A³'s extension: after the first token keep C cache tokens (prefix, question, SnapKV's top context
    # tokens per layer and KV head); 0 = no eviction. kvfuse/fusion/eviction.py, docs/methods/eviction.md.
    evict_capacity: int = Field(0, ge=0, description=(
        "A³ extension: after the first token keep this many cache tokens (prefix, question, SnapKV's top "
        "context tokens per layer and KV head); 0 = off"))
    # samkv (docs/methods/samkv.md): Eq. 4's fusion update or a plain overwrite of recomputed K/V; a
    # floor on each document's Top-P (0: the paper's Eqs. 2-3 alone); the cross-document cut on or off.
    samkv_update: Literal["fusion", "overwrite"] = Field("fusion", description=(
        'samkv: recomputed K/V blended with the cached (Eq. 4) or "overwrite"'))
    samkv_min_p: float = Field(0.0, ge=0.0, le=1.0, description=(
        "samkv: floor on each document's Top-P share of middle blocks"))
    samkv_cross_cut: bool = Field(True, description=(
        "samkv: keep at most (middle blocks of all documents / documents) middle blocks"))
    link_tokens: int = Field(5, ge=0, description=(
        "kvlink: trained link tokens after each chunk (a count the artifact was trained for, or 0 = pie)"))
    # A query whose chunks are in no tier (first use, or evicted with no object store beneath): computing
    # them after their recorded contexts can cost several full prefills (docs/DESIGN.md, "KV when it pays").
    cold_chunks: Literal["auto", "compute", "full_prefill"] = Field("auto", description=(
        "a query meeting chunks in no tier: compute them in its prefill after their recorded contexts "
        "(compute), answer with a full prefill and compute them afterwards at ingestion's share "
        "(full_prefill), or whichever prefills fewer tokens before the first (auto)"))


class FusionSettings(FusionRequestSettings):
    """config.fusion: the defaults of the request knobs, then the engine's own knobs (config only)."""

    precompute_batch_tokens: int = Field(4096, ge=1, description=(
        "chunk precompute: padded tokens per forward batch"))
    attention_block_rows: int = Field(128, ge=1, description=(
        "recompute on CPU: rows per attention block (keys before its first row unmasked, its tail masked)"))
    sparse_attention: bool = Field(True, description=(
        "recompute on CUDA: scattered rows through compiled FlexAttention with a block mask by position; "
        "off: one SDPA call with a dense [rows, keys] mask"))
    decode_cuda_graphs: bool = Field(True, description=(
        "decode on CUDA: the static step (FlexAttention over the KV memory, compiled) captured as a CUDA "
        "graph per batch-size bucket before the worker is ready; off, or on CPU: the eager step"))
    # ingest computes samkv's per-chunk artifacts (one more pass per chunk); off, samkv builds them on first use
    samkv_ingest_artifacts: bool = Field(False, description=(
        "ingest: store samkv's per-chunk artifacts with the KV (one more pass per chunk); off: built at "
        "samkv's first use of a chunk"))
    kvlink_dir: str = Field("", description=(
        "kvlink: directory of link-embedding artifacts (`kvfuse train kvlink`); empty = "
        "kvfuse/artifacts/kvlink"))


class GenerationSettings(Section):
    """Decoding defaults; a query may set `max_tokens`, `temperature` and `top_p` itself."""

    max_tokens: int = Field(256, ge=1, description="default completion length")
    max_tokens_limit: int = Field(4096, ge=1, description="larger max_tokens is refused with 422")
    temperature: float = Field(0.0, ge=0.0, le=5.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    history_max_tokens: int = Field(512, ge=0, description=(
        "tokens of earlier conversation turns (/v1/chat/completions) kept in the prompt, newest first; older "
        "turns are dropped and the answer's warning says so; 0 = the last user message only"))


class BenchSettings(Section):
    """Where `kvfuse bench` finds its evaluation data and keeps vanilla's reference outputs."""

    # The evaluation data is not part of the package; relative paths resolve from the working directory.
    data_dir: Path = Field(Path("../shared/data"), description=(
        "evaluation data of `kvfuse bench` (essays, MuSiQue); relative to the working directory; "
        "`--data-dir` overrides"))
    # Vanilla's outputs kept between fidelity runs (kvfuse.bench.reference); git-ignored by default.
    reference_dir: Path = Field(Path("bench-results/vanilla-references"), description=(
        "vanilla's answers and log-probs kept between `kvfuse bench fidelity` runs; `--reference-dir` "
        "overrides"))


class FidelitySettings(Section):
    """The quality contract (docs/DESIGN.md, "The quality contract"; docs/usage.md): shadow checks of
    fused answers against a full prefill, and a recompute ratio held at a target agreement."""

    shadow_rate: float = Field(0.0, ge=0.0, le=1.0, description=(
        "share of finished fused queries the worker re-runs as a full prefill (at the engine's lowest, "
        "preemptible priority), to compare the answers (0 = off)"))
    metric: Literal["text", "value"] = Field("value", description=(
        "answer agreement: `text` (same normalised answer) or `value` (same extracted answer: first number, "
        "else first sentence)"))
    shadow_queue: int = Field(32, ge=1, description=(
        "pending shadow checks a worker keeps (their token ids); when full the oldest is dropped, counted"))
    shadow_memory_mb: float = Field(256.0, gt=0, description=(
        "memory the pending checks' fused answer distributions may hold in a worker (fp16, one vocabulary "
        "row per answer token); past it the oldest pending checks are dropped, counted"))
    target_agreement: float = Field(0.0, ge=0.0, lt=1.0, description=(
        "agreement the ratio is held at: per method and prompt size, the lower end of its 95 % interval "
        "(0 = off; `recompute_ratio: auto` then means the configured ratio)"))
    min_ratio: float = Field(0.05, ge=0.0, le=1.0, description="lowest ratio the controller uses")
    max_ratio: float = Field(1.0, ge=0.0, le=1.0, description="highest ratio the controller uses")
    ratio_step: float = Field(0.05, gt=0.0, le=1.0, description=(
        "the controller moves the ratio by this much (min_ratio + k x step, capped at max_ratio)"))
    judge_checks: int = Field(100, ge=1, description=(
        "checks at a ratio after which the lower end of its interval must meet the target, or the ratio "
        "rises (before that it rises only when the whole interval is below the target)"))
    fall_checks: int = Field(200, ge=1, description=(
        "checks at a ratio whose interval clears the target before the controller tries one step lower"))
    size_buckets: Annotated[list[int], NoDecode] = Field([1024, 4096], description=(
        "context-token edges of the prompt-size buckets a ratio is held for (e.g. 1024, 4096: three buckets)"))
    state_file: str = Field("fidelity_state.json", description=(
        "the controller's ratios and counts, kept with the model's fingerprint; relative to data_dir"))
    query_log: bool = Field(False, description=(
        "keep the recent answered queries (question, collections, named documents, filters, system prompt, "
        "method, ratio, prompt-size bucket, time; never the answer or the key) in data_dir/query-log.jsonl, "
        "for `kvfuse calibrate --from-log`; it holds users' text: `DELETE /v1/query-log` empties it"))
    query_log_size: int = Field(2000, ge=1, description="entries the query log keeps (the most recent)")

    @field_validator("size_buckets", mode="before")
    @classmethod
    def _buckets(cls, v: Any) -> Any:
        v = string_list(v)
        return [int(x) for x in v] if isinstance(v, list) else v

    @field_validator("size_buckets")
    @classmethod
    def _sorted(cls, v: list[int]) -> list[int]:
        if any(b <= a for a, b in zip(v, v[1:], strict=False)) or any(x <= 0 for x in v):
            raise ValueError("must be positive and increasing")
        return v

    @model_validator(mode="after")
    def _ratio_bounds(self) -> FidelitySettings:
        if self.min_ratio > self.max_ratio:
            raise ValueError(f"min_ratio {self.min_ratio} is above max_ratio {self.max_ratio}")
        return self
