"""Fixtures of the store tests: settings for each index backend, a read-only directory."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


@pytest.fixture(params=["embedded", "redis"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def store_settings(backend: str, settings_factory, request: pytest.FixtureRequest):
    """Settings factory for the parametrized index backend (a unique Redis namespace per test)."""

    def make(**overrides):
        store = dict(overrides.pop("store", {}))
        if backend == "redis":
            overrides["redis_url"] = request.getfixturevalue("redis_url")
            store["redis_namespace"] = request.getfixturevalue("redis_namespace")
        else:
            overrides["redis_url"] = ""
        return settings_factory(store=store, **overrides)

    return make


@pytest.fixture
def readonly_dir(tmp_path: Path):
    """(writable source dir, the same dir seen read-only). Not root: chmod. Root ignores permissions,
    so a read-only bind mount of the same dir is used instead."""
    src = tmp_path / "src"
    src.mkdir()
    if os.geteuid() != 0:
        yield src, src  # the test makes it read-only with _make_readonly once filled
        for p in [src, *src.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        return
    mnt = tmp_path / "ro"
    mnt.mkdir()
    res = subprocess.run(["mount", "--bind", "-o", "ro", str(src), str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.fail(f"running as root, a read-only dir needs a read-only bind mount: {res.stderr.strip()}")
    try:
        yield src, mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)

