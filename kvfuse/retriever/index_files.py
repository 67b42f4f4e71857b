"""The vector index on disk: atomic save, verified load.

Under the index directory: `index-<generation>.faiss` and the sidecar `index.json` (id map, metadata,
tombstones, and the size + sha256 of the index file it belongs to). A save writes a new generation's
index file, then replaces the sidecar, each atomically (temp + fsync + rename): the sidecar's rename is
the commit, so a crash leaves the old pair or the new pair. A load verifies the pair and raises
IndexLoadError when it does not match; the caller then rebuilds from the stored documents.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from kvfuse.retriever.errors import IndexLoadError
from kvfuse.retriever.faiss_index import DocRange, IndexState
from kvfuse.retriever.files import atomic_write

SIDECAR = "index.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class SavedIndex:
    state: IndexState
    generation: int
    index_type: str  # as saved; may differ from the configured type (the caller converts it)


def is_saved(directory: Path) -> bool:
    return (Path(directory) / SIDECAR).exists()


def save_index(directory: Path, state: IndexState, *, dim: int, index_type: str, embedder_fingerprint: str,
               generation: int) -> int:
    """Write `state` as a new generation (see the module doc); returns that generation.

    `generation` is the caller's last one; the new one is also past every generation on disk, so a
    fresh index saved over a torn one never overwrites the file the old sidecar still names before the
    new sidecar lands."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    on_disk = [_generation_of(p) for p in directory.glob("index-*.faiss")]
    generation = max([generation, *on_disk]) + 1
    name = f"index-{generation:08d}.faiss"
    blob = faiss.serialize_index(state.index)
    atomic_write(directory / name, blob)
    body = {
        "format": FORMAT_VERSION,
        "dim": dim,
        "embedder_fingerprint": embedder_fingerprint,
        "index_type": index_type,
        "generation": generation,
        "next_id": state.next_id,
        "ntotal": int(state.index.ntotal),
        "index_file": {"name": name, "bytes": int(blob.nbytes), "sha256": hashlib.sha256(blob).hexdigest()},
        "documents": {d: {"start": r.start, "count": r.count, "metadata": r.metadata} for d, r in state.docs.items()},
        "tombstones": [list(t) for t in state.tombstones],
    }
    atomic_write(directory / SIDECAR, _seal(body))
    for old in directory.glob("index-*.faiss"):
        if old.name != name:
            with contextlib.suppress(OSError):
                old.unlink()
    return generation


def load_index(directory: Path, *, dim: int, embedder_fingerprint: str) -> SavedIndex:
    """Read and verify the saved pair. Raises IndexLoadError for torn or corrupt files, another
    dimension, or (when both sides know it) vectors of another embedding model."""
    directory = Path(directory)
    sidecar = directory / SIDECAR
    body = _unseal(sidecar.read_bytes(), sidecar)
    try:
        if body["format"] != FORMAT_VERSION:
            raise IndexLoadError(f"{sidecar}: format {body['format']}, this version reads {FORMAT_VERSION}")
        if body["dim"] != dim:
            raise IndexLoadError(
                f"{sidecar}: saved vectors have dimension {body['dim']}, the embedder gives {dim} "
                "(the embedding model changed): rebuild the index"
            )
        saved_fp = body.get("embedder_fingerprint", "")
        if saved_fp and embedder_fingerprint and saved_fp != embedder_fingerprint:
            raise IndexLoadError(
                f"{sidecar}: vectors come from another embedding model (fingerprint {saved_fp}, "
                f"this one is {embedder_fingerprint}): rebuild the index"
            )
        meta = body["index_file"]
        path = directory / meta["name"]
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            raise IndexLoadError(f"{path} named by {sidecar} is missing: torn index files") from None
        if len(blob) != meta["bytes"] or hashlib.sha256(blob).hexdigest() != meta["sha256"]:
            raise IndexLoadError(f"{path} does not match the size/checksum recorded in {sidecar}")
        index = faiss.deserialize_index(np.frombuffer(blob, dtype=np.uint8))
        docs = {
            d: DocRange(int(r["start"]), int(r["count"]), dict(r["metadata"])) for d, r in body["documents"].items()
        }
        state = IndexState(index, docs, int(body["next_id"]), [(int(s), int(c)) for s, c in body["tombstones"]])
        live = sum(r.count for r in docs.values())
        if index.ntotal != body["ntotal"] or index.ntotal != live + state.dead or index.d != dim:
            raise IndexLoadError(
                f"{sidecar}: counts disagree (index file {index.ntotal} vectors, sidecar {body['ntotal']}, "
                f"{live} live + {state.dead} removed)"
            )
        return SavedIndex(state, int(body["generation"]), body["index_type"])
    except (KeyError, TypeError, ValueError) as err:
        raise IndexLoadError(f"{sidecar}: malformed ({type(err).__name__}: {err})") from err


def _generation_of(path: Path) -> int:
    try:
        return int(path.stem.split("-", 1)[1])
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
    return body


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
