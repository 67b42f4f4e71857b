"""docs/models.md is rendered from the code that decides what is served (kvfuse.fusion.model.models_doc):
the committed page must be exactly what the generator renders now, and say what every family carries
and what every method and eviction refuse of a model with sliding-window layers."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfuse.cli import main
from kvfuse.fusion.methods.base import registry
from kvfuse.fusion.model import families
from kvfuse.fusion.model.models_doc import render

PAGE = Path(__file__).resolve().parents[2] / "docs" / "models.md"
STALE = "docs/models.md is stale: regenerate it with `kvfuse models docs -o docs/models.md`"


def test_committed_page_is_what_the_generator_renders() -> None:
    assert PAGE.read_text(encoding="utf-8") == render(), STALE


def test_the_page_names_every_family_method_and_refusal() -> None:
    page = render()
    for model_type, family in families.FAMILIES.items():
        assert f"| `{model_type}` | {family.models} |" in page
    for model_type in families.REFUSED:
        assert f"- `{model_type}`: " in page
    for name, cls in registry().items():
        row = next(line for line in page.splitlines() if line.startswith(f"| `{name}` |"))
        assert (cls.window_refusal or cls.window_note or "served") in row
    assert "| eviction (`fusion.evict_capacity`) | refused: " in page


def test_cli_prints_the_page(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "docs"]) == 0
    assert capsys.readouterr().out == render()
