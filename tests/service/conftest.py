"""Fixtures of the service tests (helpers live in service_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def essays3(shared_data: Path) -> dict[str, str]:
    """Three short essays (fast to ingest) with distinct topics."""
    folder = shared_data / "paul_graham_essays"
    return {name: (folder / f"{name}.txt").read_text(encoding="utf-8") for name in ("pow", "todo", "nft")}
