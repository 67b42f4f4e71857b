"""The fleet's compose deployment (docker-compose.fleet.yml), checked statically like the embedded one:
redis, a CPU api with no model and GPU workers that scale, each with a healthcheck; real settings and
real commands only."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from test_deploy import _is_setting

from kvfuse.cli import build_parser

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.fleet.yml").read_text())


def test_fleet_services(compose: dict) -> None:
    s = compose["services"]
    assert set(s) == {"redis", "api", "worker"}
    assert all("healthcheck" in svc for svc in s.values())
    api, worker = s["api"], s["worker"]
    assert api["command"][-2:] == ["--workers", "0"] and "deploy" not in api  # no GPU for the API
    assert api["image"].endswith(":cpu") and worker["image"].endswith(":gpu")
    assert worker["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert "ports" not in worker and "container_name" not in worker  # so `--scale worker=N` works
    for svc in (api, worker):
        assert svc["environment"]["KVFUSE_REDIS_URL"].startswith("redis://redis:")
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert all(_is_setting(k) for k in svc["environment"] if k.startswith("KVFUSE_"))


def test_fleet_commands_are_real(compose: dict) -> None:
    parser = build_parser()
    for argv in (compose["services"]["api"]["command"], compose["services"]["worker"]["command"],
                 compose["services"]["worker"]["healthcheck"]["test"][1:]):
        assert argv[0] == "kvfuse" and getattr(parser.parse_args(argv[1:]), "func", None)
