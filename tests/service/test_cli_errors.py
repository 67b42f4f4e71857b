"""`kvfuse ingest` and `kvfuse query` against a server that is not running: one line that names the URL
and what to check, exit status 1, no traceback (real processes, a port nobody listens on). Bad
arguments and settings stop `kvfuse serve` (and `ingest`) up front: a short message, exit status 2, and
nothing loaded or created."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from redis_server import free_port
from service_helpers import REPO


def _kvfuse(args: list[str], data_dir: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "KVFUSE_DATA_DIR": str(data_dir), "KVFUSE_SERVER__API_KEYS": "", **env}
    full.pop("KVFUSE_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "kvfuse.cli", *args], cwd=REPO, env=full, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("command", [["query", "what is it?"], ["ingest", "README.md"]])
def test_an_unreachable_server_is_one_line_naming_the_url(command: list[str], tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    out = _kvfuse([*command, "--url", url], tmp_path)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"is kvfuse serve running on {url}?" in lines[0] and lines[0].startswith(f"kvfuse {command[0]}:")


def test_ingest_with_an_empty_batch_size_stops_before_contacting_the_server(tmp_path: Path) -> None:
    # An unreachable server would be exit status 1: 2 says the argument was refused first.
    out = _kvfuse(["ingest", "README.md", "--batch", "0", "--url", f"http://127.0.0.1:{free_port()}"], tmp_path)
    assert out.returncode == 2 and "argument --batch: must be >= 1" in out.stderr, out.stderr


def _refused_before_loading(out: subprocess.CompletedProcess, data_dir: Path) -> list[str]:
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert not data_dir.exists(), "the store was opened before the arguments were checked"
    return out.stderr.strip().splitlines()


def test_serve_refuses_a_port_out_of_range_before_loading(tmp_path: Path) -> None:
    lines = _refused_before_loading(_kvfuse(["serve", "--port", "99999"], tmp_path / "data"), tmp_path / "data")
    assert lines[-1] == "kvfuse serve: error: argument --port: must be >= 1 and <= 65535, got '99999'"


def test_serve_refuses_an_address_it_cannot_listen_on_before_loading(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = _kvfuse(["serve", "--host", "127.0.0.1", "--port", str(port)], tmp_path / "data")
    lines = _refused_before_loading(out, tmp_path / "data")
    assert lines == [f"kvfuse serve: cannot listen on 127.0.0.1:{port}: Address already in use"]
    out = _kvfuse(["serve", "--host", "999.1.1.1"], tmp_path / "data", KVFUSE_SERVER__API_KEYS="k")
    lines = _refused_before_loading(out, tmp_path / "data")
    assert len(lines) == 1 and lines[0].startswith("kvfuse serve: cannot resolve the bind address '999.1.1.1'")


def test_serve_refuses_an_unknown_default_fusion_method_before_loading(tmp_path: Path) -> None:
    out = _kvfuse(["serve", "--port", str(free_port())], tmp_path / "data", KVFUSE_FUSION__METHOD="nope")
    text = "\n".join(_refused_before_loading(out, tmp_path / "data"))
    assert "fusion.method (env KVFUSE_FUSION__METHOD): unknown fusion method" in text and "'nope'" in text
    assert "anchor" in text and "vanilla" in text  # the valid methods are listed
