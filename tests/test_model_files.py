"""The prepared default model is readable by any user, whatever the umask it was prepared under: an image
prepares it as root and runs the service as another user (docs/deploy.md). Checked on the real files, and,
where the tests run as root, by reading them as the unprivileged user `nobody` in a real process."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvfuse.model_files import DEFAULT_LLM_NAME, DIR_MODE, FILE_MODE, prepare_default_llm

NOBODY = 65534


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root.parent)): stat.S_IMODE(p.stat().st_mode) for p in (root, *root.rglob("*"))}


def _read_as_nobody(folder: Path) -> subprocess.CompletedProcess:
    """Read every file of `folder` in a process running as `nobody` (as the image's service user would):
    `cat`, since this machine's Python may live where `nobody` cannot run it."""
    files = [str(p) for p in sorted(folder.rglob("*")) if p.is_file()]
    return subprocess.run(["cat", *files], user=NOBODY, group=NOBODY, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=120)


def _open_path_to(folder: Path) -> None:
    """Let `nobody` reach `folder` (pytest's temp dirs are private to their user)."""
    for parent in (folder, *folder.parents):
        if parent.stat().st_uid == os.geteuid():
            parent.chmod(parent.stat().st_mode | 0o005)


@pytest.mark.slow
def test_prepare_under_a_private_umask_gives_shared_modes(tmp_path: Path) -> None:
    """A real conversion of the packaged GGUF with umask 077 (what broke the image: mkdtemp's 0700)."""
    cache = tmp_path / "models"  # created by prepare, under the umask too
    env = {**os.environ, "KVFUSE_MODEL_CACHE_DIR": str(cache)}
    env.pop("KVFUSE_CONFIG", None)
    out = subprocess.run([sys.executable, "-m", "kvfuse.cli", "models", "prepare"], env=env, capture_output=True,
                         text=True, timeout=600, preexec_fn=lambda: os.umask(0o077))
    assert out.returncode == 0, out.stderr
    modes = _modes(cache / DEFAULT_LLM_NAME)
    assert modes[DEFAULT_LLM_NAME] == DIR_MODE and stat.S_IMODE(cache.stat().st_mode) == DIR_MODE
    assert {m for name, m in modes.items() if name != DEFAULT_LLM_NAME} == {FILE_MODE}, modes
    assert not list(cache.glob(".prepare-*"))  # no temp dir left behind
    if os.geteuid() == 0:
        _open_path_to(tmp_path)
        read = _read_as_nobody(cache / DEFAULT_LLM_NAME)
        assert read.returncode == 0, read.stderr


def test_a_private_prepared_copy_is_opened_up(tmp_path: Path, default_llm_path: str) -> None:
    """A copy prepared before (0700 folder, 0600 files) is widened by the next prepare, without converting."""
    target = tmp_path / "models" / DEFAULT_LLM_NAME
    shutil.copytree(default_llm_path, target)
    for p in target.iterdir():
        p.chmod(0o600)
    target.chmod(0o700)
    assert prepare_default_llm(tmp_path / "models") == target
    assert set(_modes(target).values()) == {DIR_MODE, FILE_MODE}
    assert stat.S_IMODE(target.stat().st_mode) == DIR_MODE
    if os.geteuid() == 0:
        _open_path_to(tmp_path / "models")
        read = _read_as_nobody(target)
        assert read.returncode == 0, read.stderr


def test_the_cli_parser_loads_no_torch() -> None:
    """`kvfuse --help`, and the health probes a container runs every few seconds, import no model code."""
    code = "import sys, kvfuse.cli; kvfuse.cli.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_the_health_probes_load_no_torch(tmp_path) -> None:
    """`kvfuse worker --health` and `kvfuse serve --health` run inside the containers every 5 s with a 10 s
    timeout: with model code imported they took seconds on a loaded host, and a ready worker turned
    unhealthy. Each answers from its status file or its HTTP probe alone."""
    code = ("import sys\nfrom kvfuse.cli import main\n"
            "codes = [main(['worker', '--health']), main(['serve', '--health', '--port', '9'])]\n"
            "print(codes, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "KVFUSE_DATA_DIR": str(tmp_path)})
    assert out.stdout.strip().splitlines()[-1] == "[1, 1] False", out
    assert "no kvfuse worker runs" in out.stderr and "not answering" in out.stderr
