"""Crash-safe file writes: a reader sees the old file or the new one, never a partial one."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any


def atomic_write(path: Path, data: Any) -> None:
    """Write `data` (bytes or any buffer) to a temp file beside `path`, fsync it, rename it over `path`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make renames inside `directory` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
