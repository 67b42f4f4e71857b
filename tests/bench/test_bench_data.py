"""Where the benchmarks find their data (the setting `bench.data_dir`, or `--data-dir`), and plotting as
an optional extra that the service never imports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvfuse.bench.data import ESSAYS_DIR, DataError, resolve_data_dir
from kvfuse.config import load_settings

REPO = Path(__file__).resolve().parents[2]


def test_data_dir_comes_from_the_setting_and_the_flag_overrides_it(shared_data: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KVFUSE_BENCH__DATA_DIR", str(shared_data))
    settings = load_settings()
    assert settings.bench.data_dir == shared_data
    assert resolve_data_dir(None, settings) == shared_data
    with pytest.raises(DataError, match="--data-dir"):
        resolve_data_dir(tmp_path, settings)  # the flag wins, even over a setting that would work


def test_missing_data_names_the_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KVFUSE_BENCH__DATA_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(DataError) as err:
        resolve_data_dir(None, load_settings())
    message = str(err.value)
    assert str(tmp_path / "nowhere" / ESSAYS_DIR) in message
    assert "bench.data_dir" in message and "KVFUSE_BENCH__DATA_DIR" in message


def test_default_data_dir_is_relative_to_the_working_directory(shared_data: Path, monkeypatch: pytest.MonkeyPatch):
    for var in [v for v in os.environ if v.startswith("KVFUSE_")]:
        monkeypatch.delenv(var)
    monkeypatch.chdir(REPO)  # the repository root, beside ../shared
    assert load_settings().bench.data_dir == Path("../shared/data")
    assert resolve_data_dir(None, load_settings()).resolve() == shared_data.resolve()


def test_the_service_and_the_cli_never_import_matplotlib():
    code = ("import sys; import kvfuse.service.api.app; from kvfuse.cli import build_parser; build_parser(); "
            "import kvfuse.bench.report; print('matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "False"


def test_plotting_without_matplotlib_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from kvfuse.bench import plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the extra were not installed
    with pytest.raises(ModuleNotFoundError, match=r"kvfuse\[bench\]"):
        plots.plot_speed([{"method": "vanilla", "context_tokens": 1024, "ttft_s_median": 0.1}], tmp_path / "s.png")
