"""Every setting of kvfuse, loaded and validated once.

Sources, highest priority first: explicit overrides passed to `load_settings`, environment variables
`KVFUSE_*` (nested keys joined with `__`), then the YAML file (`KVFUSE_CONFIG`, else `config.yaml` in the
working directory, else the copy shipped beside the package). `config.yaml` documents every key.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    YamlConfigSettingsSource,
)

REPO_CONFIG = Path(__file__).resolve().parent.parent / "config.yaml"

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


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    api_keys: Annotated[list[str], NoDecode] = []
    allow_unauthenticated_public: bool = False
    max_body_bytes: int = Field(10 * 1024 * 1024, gt=0)
    max_document_chars: int = Field(2_000_000, gt=0)
    max_batch_documents: int = Field(256, gt=0)
    request_timeout_s: float = Field(300.0, gt=0)
    queue_size: int = Field(16, ge=1)
    retry_after_s: int = Field(1, ge=0)
    ingest_wait_timeout_s: float = Field(600.0, gt=0)
    job_history_s: float = Field(7 * 86400.0, ge=0)
    precompute_batch_chunks: int = Field(4, ge=1)
    worker_start_timeout_s: float = Field(300.0, gt=0)
    worker_cancel_grace_s: float = Field(30.0, gt=0)
    worker_stop_timeout_s: float = Field(10.0, gt=0)
    workers: int = Field(1, ge=0)  # local worker processes; 0: remote `kvfuse worker`s (needs redis_url)
    max_running_requests: int = Field(16, ge=1)
    kv_budget_tokens: int = Field(65536, ge=1)
    prefill_tokens_per_step: int = Field(2048, ge=1)
    ingest_step_share: float = Field(0.25, gt=0.0, le=1.0)
    # An ingestion interrupted by something that passes (kvfuse/service/rag/ingest_retry.py) runs again: a
    # worker crash at most ingest_retry_attempts tries in all, an unreachable document index (Redis) at
    # most ingest_index_attempts; the pause before each retry doubles from backoff_s up to backoff_max_s.
    ingest_retry_attempts: int = Field(3, ge=1)
    ingest_index_attempts: int = Field(20, ge=1)
    ingest_retry_backoff_s: float = Field(1.0, ge=0)
    ingest_retry_backoff_max_s: float = Field(30.0, ge=0)
    url: str = ""

    @property
    def base_url(self) -> str:
        """Where clients reach the server: `url`, else http://host:port (a wildcard host means loopback)."""
        if self.url:
            return self.url.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, v: Any) -> Any:
        return string_list(v)


class ModelSettings(_Section):
    llm: str = "default"
    device: str = "cpu"
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    threads: int = Field(0, ge=0)
    max_context_tokens: int = Field(0, ge=0)
    system_prompt: str = "You are a helpful assistant. Answer the question using the documents. Answer briefly."
    embedder: str = "default"
    embed_batch_size: int = Field(32, ge=1)
    devices: Annotated[list[str], NoDecode] = []  # one local worker per entry in turn (server.workers > 1)

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


class StoreSettings(_Section):
    kv_dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    lmdb_map_size_mb: int = Field(1024, ge=1)
    lmdb_max_readers: int = Field(256, ge=1)
    hot_tier_mb: int = Field(512, ge=0)
    redis_namespace: str = Field("kvfuse", min_length=1)
    rebuild_index_on_empty: bool = True
    redis_timeout_s: float = Field(5.0, gt=0)
    verify_checksums: bool = True
    orphan_grace_s: float = Field(3600.0, ge=0)
    # What a chunk's KV is computed after (kvfuse/fusion/chunk_context.py): none | document | neighbours |
    # prefix; the context's tokens are part of the chunk key. Budget and neighbour count for those modes.
    precompute_context: Literal["none", "document", "neighbours", "prefix"] = "document"
    precompute_context_tokens: int = Field(1024, ge=0)
    precompute_neighbours: int = Field(2, ge=1)


class RetrievalRequestSettings(_Section):
    """The retrieval knobs a request may set (`retrieval` on /v1/query and /v1/chat/completions), declared
    once: the request schema is derived from these fields (names, defaults, bounds)."""

    # dense: FAISS over chunk embeddings; keyword: BM25 over chunk terms; hybrid: both, fused by
    # reciprocal rank (docs/DESIGN.md, "Retrieval"; measured in docs/results/retriever/).
    mode: Literal["dense", "keyword", "hybrid"] = "hybrid"
    rrf_k: int = Field(60, ge=1)  # hybrid: a chunk scores sum(1 / (rrf_k + rank)) over the two lists
    candidates: int = Field(50, ge=1)  # hybrid: how deep each list is read before fusing (at least top_k)


class RetrieverSettings(RetrievalRequestSettings):
    chunk_tokens: int = Field(512, ge=16)
    top_k: int = Field(4, ge=1)
    max_top_k: int = Field(64, ge=1)
    index_type: Literal["flat", "hnsw"] = "flat"
    hnsw_m: int = Field(32, ge=4)
    hnsw_ef_construction: int = Field(200, ge=8)
    hnsw_ef_search: int = Field(128, ge=8)
    hnsw_compact_ratio: float = Field(0.25, gt=0.0, le=1.0)  # removed share of an HNSW index that triggers its rebuild
    bm25_k1: float = Field(1.5, gt=0.0)
    bm25_b: float = Field(0.75, ge=0.0, le=1.0)
    # The keyword index's base segment is rebuilt once fresh + removed chunks pass this share of it (and
    # this many chunks): kvfuse/retriever/keyword_segments.py.
    keyword_merge_ratio: float = Field(0.1, gt=0.0, le=1.0)
    keyword_merge_min_chunks: int = Field(256, ge=0)


class FusionRequestSettings(_Section):
    """The fusion knobs a request may set, declared once: `kvfuse.fusion.FusionOptions` and the HTTP
    request's `fusion` object are derived from these fields (names, defaults, bounds)."""

    method: FusionMethodName = "anchor"  # kvfuse's own method, see docs/default_fusion.md
    recompute_ratio: float = Field(0.15, ge=0.0, le=1.0)
    check_layer: int = Field(1, ge=0)
    smooth_window: int = Field(5, ge=1)
    edge_tokens: int = Field(16, ge=0)
    edge_tokens_end: int = Field(16, ge=0)
    anchor_tokens: int = Field(16, ge=0)
    # A³'s extension: after the first token keep C cache tokens (prefix, question, SnapKV's top context
    # tokens per layer and KV head); 0 = no eviction. kvfuse/fusion/eviction.py, docs/DESIGN.md.
    evict_capacity: int = Field(0, ge=0)
    # samkv (docs/DESIGN.md, "SamKV"): Eq. 4's fusion update or a plain overwrite of recomputed K/V; a
    # floor on each document's Top-P (0: the paper's Eqs. 2-3 alone); the cross-document cut on or off.
    samkv_update: Literal["fusion", "overwrite"] = "fusion"
    samkv_min_p: float = Field(0.0, ge=0.0, le=1.0)
    samkv_cross_cut: bool = True
    link_tokens: int = Field(5, ge=0)  # kvlink: link tokens after each chunk (one of the trained counts, or 0)


class FusionSettings(FusionRequestSettings):
    """config.fusion: the defaults of the request knobs, then the engine's own knobs (config only)."""

    precompute_batch_tokens: int = Field(4096, ge=1)
    attention_block_rows: int = Field(128, ge=1)
    # ingest computes samkv's per-chunk artifacts (one more pass per chunk); off, samkv builds them on first use
    samkv_ingest_artifacts: bool = False
    kvlink_dir: str = ""  # kvlink artifacts (link embeddings per model fingerprint); "" = the packaged ones


class GenerationSettings(_Section):
    max_tokens: int = Field(256, ge=1)
    max_tokens_limit: int = Field(4096, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)


class BenchSettings(_Section):
    # The evaluation data is not part of the package; relative paths resolve from the working directory.
    data_dir: Path = Path("../shared/data")
    # Vanilla's outputs kept between fidelity runs (kvfuse.bench.reference); git-ignored by default.
    reference_dir: Path = Path("bench-results/vanilla-references")


class FleetSettings(_Section):
    """Scale-out over Redis (docs/DESIGN.md, "Scale-out"): `kvfuse serve --workers 0` dispatches to
    `kvfuse worker` processes on any host; used only when `redis_url` is set."""

    namespace: str = Field("kvfuse:fleet", min_length=1)  # key prefix of the streams, heartbeats, shared KV
    worker_name: str = ""  # a worker's name in answers and /ready (default: host-pid)
    heartbeat_s: float = Field(1.0, gt=0)
    heartbeat_ttl_s: float = Field(5.0, gt=0)  # a worker silent this long is dead: its jobs are claimed back
    reply_ttl_s: float = Field(30.0, gt=0)  # a job's reply stream outlives its reader by this much
    shared_tier_mb: int = Field(1024, ge=0)  # cap of the shared chunk KV tier in Redis (0: no shared tier)
    # Query routing (kvfuse/service/dispatch/routing.py): a worker's score is the share of the query's chunks
    # it holds minus this times its jobs over its running slots; 0 = locality alone.
    route_load_weight: float = Field(8.0, ge=0)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVFUSE_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    data_dir: Path = Path("./data")
    model_cache_dir: Path | None = None
    redis_url: str = ""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    server: ServerSettings = ServerSettings()
    model: ModelSettings = ModelSettings()
    store: StoreSettings = StoreSettings()
    retriever: RetrieverSettings = RetrieverSettings()
    fusion: FusionSettings = FusionSettings()
    generation: GenerationSettings = GenerationSettings()
    bench: BenchSettings = BenchSettings()
    fleet: FleetSettings = FleetSettings()

    @field_validator("model_cache_dir", mode="before")
    @classmethod
    def _empty_is_none(cls, v: Any) -> Any:
        return None if v == "" else v

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str) -> str:
        if v and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix:// (or be empty for the embedded index)")
        return v

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, YamlConfigSettingsSource(settings_cls, yaml_file=config_path()))

    # Derived locations under the data dir: one place for every path the service writes.
    @property
    def lmdb_dir(self) -> Path:
        return self.data_dir / "lmdb"

    @property
    def faiss_dir(self) -> Path:
        return self.data_dir / "faiss"

    @property
    def keyword_dir(self) -> Path:
        return self.data_dir / "keyword"

    @property
    def models_dir(self) -> Path:
        return self.model_cache_dir or self.data_dir / "models"


class ConfigError(ValueError):
    """A setting is invalid; the message names the key (dotted) and the reason."""


def config_path() -> Path | None:
    explicit = os.environ.get("KVFUSE_CONFIG")
    if explicit:
        return Path(explicit)
    local = Path("config.yaml")
    if local.is_file():
        return local
    return REPO_CONFIG if REPO_CONFIG.is_file() else None


def _error_line(loc: tuple | list, msg: str, value: Any) -> str:
    key = ".".join(str(p) for p in loc)
    env = "KVFUSE_" + "__".join(str(p) for p in loc).upper()
    return f"  {key} (env {env}): {msg} (got {value!r})"


def _format_errors(err: ValidationError) -> str:
    lines = [_error_line(e["loc"], e["msg"], e.get("input")) for e in err.errors()]
    return "invalid kvfuse configuration:\n" + "\n".join(lines)


def setting_error(loc: tuple[str, ...], msg: str, value: Any) -> ConfigError:
    """A bad setting that only a package this module cannot import can judge (the fusion registry owns
    the method names), worded as `load_settings` words its own errors."""
    return ConfigError("invalid kvfuse configuration:\n" + _error_line(loc, msg, value))


def load_settings(**overrides: Any) -> Settings:
    """Load and validate the settings; raises ConfigError naming each bad key."""
    path = os.environ.get("KVFUSE_CONFIG")
    if path and not Path(path).is_file():
        raise ConfigError(f"invalid kvfuse configuration: KVFUSE_CONFIG={path} is not a file")
    try:
        return Settings(**overrides)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None
    except (SettingsError, OSError, ValueError) as err:  # unparsable env value or YAML file
        raise ConfigError(f"invalid kvfuse configuration: {err}") from None


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, loaded once."""
    return load_settings()


def config_table_markdown(path: Path = REPO_CONFIG) -> str:
    """The README's configuration table, generated from config.yaml's keys, defaults and comments."""
    import re

    rows, stack = [], []
    for line in path.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        level = (len(line) - len(line.lstrip())) // 2
        key, rest = re.match(r"\s*([a-z0-9_]+):\s*(.*)$", line).groups()
        stack = stack[:level]
        if not rest:
            stack.append(key)
            continue
        value, _, comment = rest.partition("#")
        dotted = ".".join([*stack, key])
        env = "KVFUSE_" + "__".join([*stack, key]).upper()
        cell = comment.strip().replace("|", "\\|")
        rows.append(f"| `{dotted}` | `{env}` | `{value.strip()}` | {cell} |")
    return "\n".join(["| key | env var | default | meaning |", "|---|---|---|---|", *rows])
