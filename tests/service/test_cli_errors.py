"""`kvfuse ingest` and `kvfuse query` against a server that is not running: one line that names the URL
and what to check, exit status 1, no traceback (real processes, a port nobody listens on); a setting
the service would ignore stops `kvfuse serve` with one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from redis_server import free_port
from service_helpers import REPO


@pytest.mark.parametrize("command", [["query", "what is it?"], ["ingest", "README.md"]])
def test_an_unreachable_server_is_one_line_naming_the_url(command: list[str], tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "KVFUSE_DATA_DIR": str(tmp_path)}
    env.pop("KVFUSE_CONFIG", None)
    out = subprocess.run([sys.executable, "-m", "kvfuse.cli", *command, "--url", url], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"is kvfuse serve running on {url}?" in lines[0] and lines[0].startswith(f"kvfuse {command[0]}:")
