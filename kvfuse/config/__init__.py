"""Every setting of kvfuse, loaded and validated once.

Sources, highest priority first: explicit overrides passed to `load_settings`, environment variables
`KVFUSE_*` (nested keys joined with `__`), then the YAML file (`KVFUSE_CONFIG`, else `config.yaml` in the
working directory, else the copy shipped beside the package). `config.yaml` lists every key with its
default; each field's description is the reference, rendered into docs/configuration.md by
`kvfuse config docs` (kvfuse/config_docs.py). The sections live in `sections.py` (what the model,
retrieval, storage and fusion do) and `serving.py` (the server, its keys, Redis and the fleet).
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    YamlConfigSettingsSource,
)

from kvfuse.config.sections import (  # the sections are part of this module's interface
    DEFAULT_COLLECTION,
    BenchSettings,
    FidelitySettings,
    FusionMethodName,
    FusionRequestSettings,
    FusionSettings,
    GenerationSettings,
    ModelSettings,
    RetrievalRequestSettings,
    RetrieverSettings,
    StoreSettings,
    string_list,
)
from kvfuse.config.serving import (  # part of the interface too
    FleetSettings,
    ObjectStoreSettings,
    RedisSettings,
    ServerSettings,
)

__all__ = [
    "DEFAULT_COLLECTION", "REPO_CONFIG", "BenchSettings", "ConfigError", "FidelitySettings", "FleetSettings",
    "FusionMethodName", "FusionRequestSettings", "FusionSettings", "GenerationSettings", "ModelSettings",
    "ObjectStoreSettings",
    "RedisSettings", "RetrievalRequestSettings", "RetrieverSettings", "ServerSettings", "Settings", "StoreSettings",
    "config_path", "get_settings", "load_settings", "setting_error", "string_list",
]

REPO_CONFIG = Path(__file__).resolve().parents[2] / "config.yaml"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVFUSE_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    data_dir: Path = Field(Path("./data"), description=(
        "LMDB store, FAISS index and the local model cache live here"))
    model_cache_dir: Path | None = Field(None, description="prepared model copies; empty = <data_dir>/models")
    redis_url: str = Field("", description=(
        "redis://[user:password@]host:6379/0 (rediss:// for TLS) for the Redis index; empty = index embedded "
        "in LMDB"))
    api_key: str = Field("", description=(
        "one API key with full access, beside server.api_keys; the variable clients send their key from"))
    api_key_file: str = Field("", description=(
        "a file holding one API key with full access (a docker or Kubernetes secret)"))
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description=(
        "debug | info | warning | error"))
    server: ServerSettings = ServerSettings()
    model: ModelSettings = ModelSettings()
    store: StoreSettings = StoreSettings()
    retriever: RetrieverSettings = RetrieverSettings()
    fusion: FusionSettings = FusionSettings()
    generation: GenerationSettings = GenerationSettings()
    bench: BenchSettings = BenchSettings()
    fleet: FleetSettings = FleetSettings()
    redis: RedisSettings = RedisSettings()
    object_store: ObjectStoreSettings = ObjectStoreSettings()
    fidelity: FidelitySettings = FidelitySettings()

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


def _error_line(loc: tuple[int | str, ...] | list[int | str], msg: str, value: Any) -> str:
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

