"""The real Gemma 3 270M (tests/conftest.py `gemma3_path`) in the 16-bit dtypes, through `kvfuse models
check`: in bfloat16 the engine is within the check's rounding bound of transformers at every check; in
float16 transformers' own forward overflows (the model's residual stream grows past float16's largest
value, 65504), so the check refuses the dtype by name instead of failing on a NaN at some layer
(docs/models.md, "Dtypes")."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfuse.cli import main

pytestmark = pytest.mark.slow


def test_gemma3_passes_the_check_in_bfloat16(gemma3_path: Path, capsys) -> None:
    assert main(["models", "check", str(gemma3_path), "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "gemma3_text: 8 checks" in out and "passed" in out, out


def test_gemma3_in_float16_is_refused_for_its_range(gemma3_path: Path, capsys) -> None:
    assert main(["models", "check", str(gemma3_path), "--dtype", "float16"]) == 2
    out = capsys.readouterr().out
    assert "range" in out and "overflows" in out and "serve it in bfloat16 or float32" in out, out
    assert "nan" not in out.lower(), out  # said as what it is, not as an error of NaN at some layer
