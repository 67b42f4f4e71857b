"""The compose deployment, checked statically (no Docker engine runs here): it parses, every env var it
sets is a real setting, every command is a real CLI command, the healthcheck path is a real route."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from kvfuse.cli import build_parser
from kvfuse.config import Settings

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def _is_setting(env_name: str) -> bool:
    from pydantic import BaseModel

    model: type[BaseModel] = Settings
    parts = env_name.removeprefix("KVFUSE_").lower().split("__")
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            return False
        if i < len(parts) - 1:
            if not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
                return False
            model = field.annotation
    return True


def test_compose_services(compose: dict):
    assert set(compose["services"]) == {"redis", "kvfuse"}
    redis = compose["services"]["redis"]
    cmd = " ".join(redis["command"])
    assert "--appendonly yes" in cmd and "--maxmemory-policy noeviction" in cmd
    assert redis["healthcheck"]["test"][-2:] == ["redis-cli", "ping"]
    assert any(v.endswith(":/data") for v in redis["volumes"])
    kv = compose["services"]["kvfuse"]
    assert kv["depends_on"]["redis"]["condition"] == "service_healthy"
    devices = kv["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert kv["environment"]["KVFUSE_REDIS_URL"].startswith("redis://redis:")
    assert any(v.endswith(":/data") for v in kv["volumes"])
    assert kv["environment"]["KVFUSE_DATA_DIR"] == "/data"
    start = kv["healthcheck"]["start_period"]
    assert int(re.fullmatch(r"(\d+)s", start).group(1)) >= 120, "model load needs a long start period"


def test_compose_env_vars_are_real_settings(compose: dict):
    for service in compose["services"].values():
        for name in (service.get("environment") or {}):
            if name.startswith("KVFUSE_"):
                assert _is_setting(name), f"{name} is not a kvfuse setting"


def test_compose_and_dockerfile_commands_are_real_cli_commands(compose: dict):
    parser = build_parser()
    commands = [compose["services"]["kvfuse"]["command"]]
    dockerfile = (REPO / "Dockerfile").read_text()
    cmd_line = re.search(r"^CMD (\[.*\])$", dockerfile, re.M).group(1)
    commands.append(yaml.safe_load(cmd_line))
    for run in re.findall(r"&& (kvfuse [^\\\n&]+)", dockerfile):
        commands.append(shlex.split(run))
    assert len(commands) >= 3
    for argv in commands:
        assert argv[0] == "kvfuse"
        args = parser.parse_args(argv[1:])
        assert getattr(args, "func", None), f"{argv} is not a runnable command"


def test_healthcheck_path_is_a_route(compose: dict):
    from kvfuse.config import load_settings
    from kvfuse.service.api.app import create_app

    test = " ".join(compose["services"]["kvfuse"]["healthcheck"]["test"])
    path = re.search(r"http://127\.0\.0\.1:8000(/[a-z]+)", test).group(1)
    app = create_app(load_settings())
    assert path in app.openapi()["paths"]
    assert path == "/ready"
