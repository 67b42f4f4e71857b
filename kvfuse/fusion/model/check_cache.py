"""A passed model check, remembered, so a restart of the same model on the same code does not pay for it
again (the check runs the model some fifteen times: seconds on a CPU, at every container restart).

A pass is keyed on everything its verdict depends on: the model's fingerprint (weights, config,
tokenizer, dtype, the family's KV revision), the device type (and the GPU's name on CUDA, whose kernels
differ), torch's and transformers' versions, and a hash of the engine's own source (every file under
kvfuse/fusion/), so any change to how kvfuse computes the model checks it again. Failures are not
remembered: a model that failed is checked at every start, and refused each time.

Where: `<models_dir>/checks/` (beside the prepared models, so every data dir that shares them shares the
verdicts) when it can be written, else `<data_dir>/model-checks/` (an image whose models are read-only).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch

log = logging.getLogger("kvfuse.fusion")

_SOURCE = Path(__file__).resolve().parent.parent  # kvfuse/fusion


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """sha256 of the engine's source: every .py under kvfuse/fusion/, by relative path and content."""
    h = hashlib.sha256()
    for path in sorted(_SOURCE.rglob("*.py")):
        h.update(str(path.relative_to(_SOURCE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def verdict_key(engine) -> str:
    import transformers

    device = engine.device.type
    if device == "cuda":
        device += ":" + torch.cuda.get_device_name(engine.device)
    parts = [engine.fingerprint, device, str(engine.dtype), torch.__version__, transformers.__version__, source_hash()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def verdict_dirs(settings) -> list[Path]:
    return [Path(settings.models_dir) / "checks", Path(settings.data_dir) / "model-checks"]


def passed_before(dirs: list[Path], key: str) -> Path | None:
    for folder in dirs:
        path = folder / f"{key}.json"
        if path.is_file():
            return path
    return None


def remember(dirs: list[Path], key: str, record: dict) -> Path | None:
    """Write the pass into the first folder that takes it (atomically); None when none does."""
    for folder in dirs:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f)
            os.chmod(tmp, 0o644)
            os.replace(tmp, folder / f"{key}.json")
            return folder / f"{key}.json"
        except OSError as err:
            log.debug("model check verdict not kept in %s: %s", folder, err)
    return None


def check_once(engine, settings) -> None:
    """Check `engine` unless this model on this code and stack passed before; raise ModelCheckError on a
    failure (kvfuse/fusion/model/check.py)."""
    from kvfuse.fusion.model.check import check_model

    dirs = verdict_dirs(settings)
    key = verdict_key(engine)
    found = passed_before(dirs, key)
    if found is not None:
        log.info("model check skipped: this model passed it on this code, device and torch before (%s)", found)
        return
    report = check_model(engine)
    report.raise_on_failure()
    remember_pass(engine, report, settings)


def remember_pass(engine, report, settings) -> Path | None:
    """Keep a passed report (`kvfuse models check` keeps its passes too, so an image can check its model
    at build time and its containers start without checking); None when it failed or no folder took it."""
    if not report.ok:
        return None
    return remember(verdict_dirs(settings), verdict_key(engine), {
        "model_type": report.model_type, "tokens": report.tokens, "seconds": round(report.seconds, 2),
        "checks": report.lines(), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
