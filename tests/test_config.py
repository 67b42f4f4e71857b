"""Configuration: every key documented in config.yaml, env overrides, clear errors naming the key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from kvfuse.config import REPO_CONFIG, ConfigError, Settings, load_settings


def _leaf_keys(tree: dict, prefix: str = "") -> set[str]:
    keys = set()
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict):
            keys |= _leaf_keys(v, path + ".")
        else:
            keys.add(path)
    return keys


def _model_keys(model: type, prefix: str = "") -> set[str]:
    from pydantic import BaseModel

    keys = set()
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys |= _model_keys(ann, f"{prefix}{name}.")
        else:
            keys.add(f"{prefix}{name}")
    return keys


def test_config_yaml_documents_every_setting_with_a_comment():
    raw = yaml.safe_load(REPO_CONFIG.read_text())
    assert _leaf_keys(raw) == _model_keys(Settings)
    for line in REPO_CONFIG.read_text().splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#") and not stripped.endswith(":"):
            assert "#" in line, f"config.yaml line without a comment: {line!r}"


def test_yaml_defaults_match_code_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # The file and the model must agree, so running without config.yaml changes nothing.
    for var in [v for v in os.environ if v.startswith("KVFUSE_")]:
        monkeypatch.delenv(var)
    from_file = load_settings()
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    monkeypatch.setenv("KVFUSE_CONFIG", str(empty))
    assert load_settings().model_dump() == from_file.model_dump()


def test_env_overrides_nested_keys(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KVFUSE_DATA_DIR", "/tmp/kvfuse-x")
    monkeypatch.setenv("KVFUSE_SERVER__PORT", "9123")
    monkeypatch.setenv("KVFUSE_FUSION__RECOMPUTE_RATIO", "0.3")
    monkeypatch.setenv("KVFUSE_SERVER__API_KEYS", "k1, k2")
    s = load_settings()
    assert s.data_dir == Path("/tmp/kvfuse-x")
    assert s.server.port == 9123
    assert s.fusion.recompute_ratio == 0.3
    assert s.server.api_keys == ["k1", "k2"]
    assert s.lmdb_dir == Path("/tmp/kvfuse-x/lmdb")


@pytest.mark.parametrize(
    ("var", "value", "key"),
    [
        ("KVFUSE_SERVER__PORT", "not-a-port", "server.port"),
        ("KVFUSE_FUSION__RECOMPUTE_RATIO", "1.5", "fusion.recompute_ratio"),
        ("KVFUSE_MODEL__DEVICE", "tpu", "model.device"),
        ("KVFUSE_REDIS_URL", "http://nope", "redis_url"),
        ("KVFUSE_STORE__KV_DTYPE", "int2", "store.kv_dtype"),
    ],
)
def test_bad_value_names_the_key(monkeypatch: pytest.MonkeyPatch, var: str, value: str, key: str):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as err:
        load_settings()
    assert key in str(err.value) and var in str(err.value)


def test_unknown_key_in_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("server:\n  prot: 1\n")
    monkeypatch.setenv("KVFUSE_CONFIG", str(cfg))
    with pytest.raises(ConfigError, match="server.prot"):
        load_settings()


def test_missing_config_file_is_refused(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KVFUSE_CONFIG", "/nonexistent/kvfuse.yaml")
    with pytest.raises(ConfigError, match="KVFUSE_CONFIG"):
        load_settings()


@pytest.mark.parametrize(("value", "keys"), [
    ('["k"]', ["k"]),  # a JSON list, as other tools write it: the key is k, not the text ["k"]
    ('["k1", "k2,with a comma"]', ["k1", "k2,with a comma"]),
    ("k1, k2", ["k1", "k2"]),
    ("", []),
])
def test_a_list_setting_from_the_environment_is_a_json_list_or_comma_separated(
        monkeypatch: pytest.MonkeyPatch, value: str, keys: list[str]):
    monkeypatch.setenv("KVFUSE_SERVER__API_KEYS", value)
    assert load_settings().server.api_keys == keys
    monkeypatch.setenv("KVFUSE_MODEL__DEVICES", '["cuda:0", "cpu"]')
    assert load_settings().model.devices == ["cuda:0", "cpu"]


@pytest.mark.parametrize("value", ['["k"', "[1, 2]", '["k", ["nested"]]'])
def test_a_list_setting_that_looks_like_json_but_is_not_a_list_of_strings_is_refused(
        monkeypatch: pytest.MonkeyPatch, value: str):
    monkeypatch.setenv("KVFUSE_SERVER__API_KEYS", value)
    with pytest.raises(ConfigError) as err:
        load_settings()
    assert "server.api_keys" in str(err.value) and "KVFUSE_SERVER__API_KEYS" in str(err.value)
