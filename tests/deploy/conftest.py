"""The deployment test's engine and images, shared by its tests (one engine and one build per session).

The tests here run only when asked for (`pytest -m deploy`, `make test-deploy`): `make test` deselects
them. Where Docker cannot run (no root, no kernel support, packages that may not be installed), they skip
saying why, except where KVFUSE_DEPLOY_REQUIRED=1 (.ci/run sets it): there they fail, saying why.
KVFUSE_DEPLOY_INSTALL=1 lets them install Debian's docker.io and debootstrap (CI may, being required).
KVFUSE_DEPLOY_CACHE (default /var/cache/kvfuse-deploy-test) keeps the Debian root, the engine's data root
(images and build layers) and the compose plugin between runs.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import pytest
from compose_stack import Phases
from deploy_images import (
    build_base,
    build_kvfuse,
    build_redis,
    build_seaweedfs,
    import_debian,
    rootfs_tarball,
)
from docker_engine import DockerEngine, EngineUnavailable, ensure_tools

REQUIRED = os.environ.get("KVFUSE_DEPLOY_REQUIRED") == "1"
CACHE = Path(os.environ.get("KVFUSE_DEPLOY_CACHE", "/var/cache/kvfuse-deploy-test"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the deploy tests out of a run that did not ask for them by marker."""
    if "deploy" in (config.option.markexpr or ""):
        return
    mine = [i for i in items if i.get_closest_marker("deploy")]
    if mine:
        config.hook.pytest_deselected(items=mine)
        items[:] = [i for i in items if not i.get_closest_marker("deploy")]


def _unavailable(why: str) -> None:
    if REQUIRED:
        pytest.fail(f"the deployment test is required here (KVFUSE_DEPLOY_REQUIRED=1) but Docker cannot run: {why}",
                    pytrace=False)
    pytest.skip(f"Docker cannot run here: {why}")


@pytest.fixture(scope="session")
def phases(pytestconfig: pytest.Config) -> Phases:
    Phases.capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    p = Phases()
    yield p
    if p.done:
        Phases.say(p.summary())
        with contextlib.suppress(OSError):  # a cache dir that cannot be made was reported already
            CACHE.mkdir(parents=True, exist_ok=True)
            (CACHE / "last-run-phases.json").write_text(p.as_json())


@pytest.fixture(scope="session")
def engine(phases: Phases) -> DockerEngine:
    """A private dockerd with a Compose v2 plugin, stopped at the end of the session."""
    try:
        with phases("tools (docker.io, debootstrap)"):
            ensure_tools(may_install=REQUIRED or os.environ.get("KVFUSE_DEPLOY_INSTALL") == "1")
        CACHE.mkdir(parents=True, exist_ok=True)
        eng = DockerEngine(CACHE)
        with phases("start the Docker engine"):
            eng.start()
    except (EngineUnavailable, OSError, RuntimeError) as err:  # RuntimeError: an install that failed
        _unavailable(str(err))
    Phases.say(f"engine up: storage driver {eng.driver}, data root under {CACHE}")
    try:
        with phases("compose v2 plugin"):
            Phases.say(f"docker compose {eng.install_compose()}")
        yield eng
    except EngineUnavailable as err:
        _unavailable(str(err))
    finally:
        with phases("stop the Docker engine"):
            eng.stop()


@pytest.fixture(scope="session")
def images(engine: DockerEngine, phases: Phases) -> dict[str, object]:
    """The base, Redis, SeaweedFS and kvfuse:cpu images (built with no registry); what the base image carries."""
    with phases("debootstrap the Debian root (cached)"):
        tarball = rootfs_tarball(CACHE)
    with phases("import the Debian root"):
        debian = import_debian(engine, tarball)
    with phases("base image (pip configuration carried in)"):
        carried = build_base(engine, debian, CACHE)
    Phases.say(f"the base image carries {carried}")
    with phases("redis image"):
        build_redis(engine, debian)
    with phases("seaweedfs image"):
        build_seaweedfs(engine)
    with phases("kvfuse:cpu image (compose build)"), tempfile.TemporaryDirectory() as scratch:
        build_kvfuse(engine, Path(scratch))
    return carried
