"""A data file and its sealed JSON sidecar: the commit protocol every retrieval index on disk follows.

Under a directory: `<stem>-<generation>.<ext>` (the data) and the sidecar `<stem>.json` (what the caller
describes, plus the data file's name, size and sha256, sealed by a checksum of its own body). A save
writes a new generation's data file, then replaces the sidecar, each atomically (temp + fsync + rename):
the sidecar's rename is the commit, so a crash leaves the old pair or the new pair. A load verifies the
pair and raises IndexLoadError when it does not match; the caller then rebuilds from the stored documents.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any

from kvfuse.retriever.errors import IndexLoadError
from kvfuse.retriever.files import atomic_write


def sidecar_path(directory: Path, stem: str) -> Path:
    return Path(directory) / f"{stem}.json"


def save_pair(directory: Path, stem: str, ext: str, blob: Any, body: dict, generation: int) -> int:
    """Write `blob` (bytes or a buffer) as a new generation and `body` as its sidecar; returns the
    generation written.

    `generation` is the caller's last one; the new one is also past every generation on disk, so a
    fresh index saved over a torn one never overwrites the file the old sidecar still names before the
    new sidecar lands."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    pattern = f"{stem}-*.{ext}"
    on_disk = [_generation_of(p) for p in directory.glob(pattern)]
    generation = max([generation, *on_disk]) + 1
    name = f"{stem}-{generation:08d}.{ext}"
    view = memoryview(blob).cast("B")
    atomic_write(directory / name, view)
    sealed = {**body, "generation": generation,
              "index_file": {"name": name, "bytes": view.nbytes, "sha256": hashlib.sha256(view).hexdigest()}}
    atomic_write(sidecar_path(directory, stem), _seal(sealed))
    for old in directory.glob(pattern):
        if old.name != name:
            with contextlib.suppress(OSError):
                old.unlink()
    return generation


def load_pair(directory: Path, stem: str) -> tuple[dict, bytes]:
    """(sidecar body, data file bytes), both verified. Raises IndexLoadError for a torn, edited or
    missing file."""
    directory = Path(directory)
    sidecar = sidecar_path(directory, stem)
    body = _unseal(sidecar.read_bytes(), sidecar)
    try:
        meta = body["index_file"]
        path = directory / meta["name"]
        size, digest = int(meta["bytes"]), str(meta["sha256"])
    except (KeyError, TypeError, ValueError) as err:
        raise IndexLoadError(f"{sidecar}: malformed ({type(err).__name__}: {err})") from err
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        raise IndexLoadError(f"{path} named by {sidecar} is missing: torn index files") from None
    if len(blob) != size or hashlib.sha256(blob).hexdigest() != digest:
        raise IndexLoadError(f"{path} does not match the size/checksum recorded in {sidecar}")
    return body, blob


def _generation_of(path: Path) -> int:
    try:
        return int(path.stem.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return 0


def _seal(body: dict) -> bytes:
    """The sidecar carries a checksum of its own body: a truncated or edited sidecar is detected."""
    return json.dumps({"sha256": _digest(body), "body": body}, indent=1).encode()


def _unseal(data: bytes, path: Path) -> dict:
    try:
        outer = json.loads(data)
        body = outer["body"]
        ok = _digest(body) == outer["sha256"]
    except (ValueError, KeyError, TypeError) as err:
        raise IndexLoadError(f"{path} is unreadable ({type(err).__name__}: {err}): torn or corrupt sidecar") from err
    if not ok:
        raise IndexLoadError(f"{path} fails its checksum: torn or edited sidecar")
    if not isinstance(body, dict):
        raise IndexLoadError(f"{path}: malformed (the body is not an object)")
    return body


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
