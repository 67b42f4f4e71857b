"""`make test` on a machine where no Redis runs: the tests that need Redis get a private redis-server
(tests/conftest.py's redis_url, tests/redis_server.py), or, with no redis-server installed, are skipped
with a message that says so, instead of failing. Each case runs a real pytest session in a subprocess,
pointed at a port where nothing listens."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from redis_server import answers, free_port

REPO = Path(__file__).resolve().parent.parent
NEEDS_REDIS = "tests/store/test_redis_index.py::test_index_is_rebuilt_from_lmdb_after_a_flush"


def _pytest(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    dead = f"redis://127.0.0.1:{free_port()}/15"
    assert not answers(dead)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-rs", "-p", "no:cacheprovider",
                           "--basetemp", str(tmp_path / "t"), NEEDS_REDIS], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "KVFUSE_TEST_REDIS_URL": dead, **env})


def test_no_redis_running_starts_a_private_one(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    out = _pytest(tmp_path)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout + out.stderr
    private = re.search(r"using a private redis-server at (redis://127\.0\.0\.1:\d+/15)", out.stdout)
    assert private, out.stdout
    assert not answers(private.group(1)), "the private redis-server outlived the session"


def test_no_redis_and_no_redis_server_skips_saying_why(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    out = _pytest(tmp_path, PATH=str(empty))  # a PATH with no redis-server on it
    assert out.returncode == 0 and "1 skipped" in out.stdout, out.stdout + out.stderr
    assert "no Redis answers at" in out.stdout and "redis-server is not installed" in out.stdout, out.stdout
