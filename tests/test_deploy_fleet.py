"""The fleet's compose deployment (docker-compose.fleet.yml), checked statically like the embedded one
(test_deploy.py also checks its healthchecks, Redis password and env vars): redis, a CPU api with no
model and GPU workers that scale; real settings and real commands only."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from test_deploy import _is_setting

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.fleet.yml").read_text())


def test_fleet_services(compose: dict) -> None:
    s = compose["services"]
    assert set(s) == {"redis", "seaweedfs", "api", "worker"}
    api, worker = s["api"], s["worker"]
    assert api["command"][-2:] == ["--workers", "0"] and "deploy" not in api  # no GPU for the API
    assert api["image"].endswith(":cpu") and worker["image"].endswith(":gpu")
    assert worker["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert "ports" not in worker and "container_name" not in worker  # so `--scale worker=N` works
    assert worker["healthcheck"]["test"] == ["CMD", "kvfuse", "worker", "--health"]
    assert "api_key" not in worker["secrets"]  # a worker answers no client: it needs Redis only
    for svc in (api, worker):
        assert svc["environment"]["KVFUSE_REDIS_URL"].startswith("redis://redis:")
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert all(_is_setting(k) for k in svc["environment"] if k.startswith("KVFUSE_"))
        # chunk KV in the fleet's object store, beneath every host's tiers
        assert svc["environment"]["KVFUSE_OBJECT_STORE__URL"].startswith("s3://")
        assert svc["environment"]["KVFUSE_OBJECT_STORE__ENDPOINT"] == "http://seaweedfs:8333"
        assert svc["depends_on"]["seaweedfs"]["condition"] == "service_healthy"
    weed = s["seaweedfs"]
    assert weed["build"]["dockerfile"] == "seaweedfs.Dockerfile" and "ports" not in weed  # compose network only
    assert weed["volumes"] == ["seaweedfs-data:/data"] and "seaweedfs-data" in compose["volumes"]
    assert "s3.config" in " ".join(weed["command"]) and weed["secrets"] == ["s3_secret_key"]
