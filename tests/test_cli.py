"""The `kvfuse` command and the README that documents it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "kvfuse.cli", "--help"], capture_output=True, text=True, check=True)
    for command in ("serve", "ingest", "query", "store", "bench", "models", "config", "train"):
        assert command in out.stdout


def test_readme_quickstart_is_the_two_make_commands():
    readme = (REPO / "README.md").read_text()
    quick = readme.split("## Quickstart", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in quick.strip().splitlines()]
    assert commands == ["make serve", "make test"]
    ci = (REPO / ".ci" / "run").read_text()
    assert "make test" in ci


def test_models_prepare_is_idempotent_and_quick(default_llm_path):
    # default_llm_path has prepared the copy; a second prepare must not convert again.
    import time

    from kvfuse.model_files import prepare_default_llm

    start = time.monotonic()
    path = prepare_default_llm(Path(default_llm_path).parent)
    assert str(path) == default_llm_path
    assert time.monotonic() - start < 1.0
