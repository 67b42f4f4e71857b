"""docs/configuration.md is rendered from the settings' declarations (kvfuse.config_docs): the committed
page must be exactly what the generator renders now, and must name every setting."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvfuse.cli import main
from kvfuse.config import REPO_CONFIG, load_settings
from kvfuse.config_docs import env_var, leaf_fields, render

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
STALE = "docs/configuration.md is stale: regenerate it with `kvfuse config docs -o docs/configuration.md`"


def _rows() -> dict[str, str]:
    """The page's table rows by their key (the first cell)."""
    lines = PAGE.read_text(encoding="utf-8").splitlines()
    return {line.split("|")[1].strip().strip("`"): line for line in lines if line.startswith("| `")}


def test_committed_page_is_what_the_generator_renders():
    assert PAGE.read_text(encoding="utf-8") == render(), STALE


def test_every_setting_has_one_row_with_its_env_var_and_a_description():
    rows = _rows()
    keys = [".".join(path) for path, _ in leaf_fields()]
    assert sorted(rows) == sorted(keys)
    for path, field in leaf_fields():
        key = ".".join(path)
        assert field.description, f"{key}: no Field(description=...) in kvfuse/config.py"
        assert f"| `{env_var(path)}` |" in rows[key]


def test_the_env_vars_named_are_the_ones_read(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(env_var(("fleet", "route_load_weight")), "3.5")
    monkeypatch.setenv(env_var(("log_level",)), "debug")
    s = load_settings()
    assert s.fleet.route_load_weight == 3.5 and s.log_level == "debug"


def test_config_yaml_comments_are_the_descriptions():
    # config.yaml lists every key with its default and, as its comment, the field's own description.
    comments, stack = {}, []
    for line in REPO_CONFIG.read_text().splitlines():
        m = re.match(r"( *)([a-z0-9_]+):\s*(\"[^\"]*\"|[^#]*?)\s*(?:#\s*(.*))?$", line)
        if not m:
            continue
        indent, key, value, comment = m.groups()
        stack = stack[: len(indent) // 2]
        if value:
            comments[".".join([*stack, key])] = comment
        else:
            stack.append(key)
    for path, field in leaf_fields():
        key = ".".join(path)
        assert comments[key] == field.description, f"config.yaml's comment on {key} differs from kvfuse/config.py"


def test_cli_prints_the_page(capsys: pytest.CaptureFixture[str]):
    assert main(["config", "docs"]) == 0
    assert capsys.readouterr().out == render()
