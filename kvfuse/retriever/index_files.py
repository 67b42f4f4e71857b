"""The vector index on disk: atomic save, verified load.

Under the index directory: `index-<generation>.faiss` and the sidecar `index.json` (id map, metadata,
collections, tombstones), written and verified by the sealed-pair protocol of `sealed` (the sidecar's
rename is the commit; a torn or corrupt pair raises IndexLoadError and the caller rebuilds it from the
stored documents).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from kvfuse.config import DEFAULT_COLLECTION
from kvfuse.retriever.errors import IndexLoadError
from kvfuse.retriever.faiss_index import DocRange, IndexState
from kvfuse.retriever.sealed import load_pair, save_pair, sidecar_path

STEM = "index"
SIDECAR = f"{STEM}.json"
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
    """Write `state` as a new generation (see the module doc); returns that generation."""
    blob = faiss.serialize_index(state.index)
    body = {
        "format": FORMAT_VERSION,
        "dim": dim,
        "embedder_fingerprint": embedder_fingerprint,
        "index_type": index_type,
        "next_id": state.next_id,
        "ntotal": int(state.index.ntotal),
        "documents": {d: _doc_entry(r) for d, r in state.docs.items()},
        "tombstones": [list(t) for t in state.tombstones],
    }
    return save_pair(directory, STEM, "faiss", blob, body, generation)


def _doc_entry(r: DocRange) -> dict:
    entry = {"start": r.start, "count": r.count, "metadata": r.metadata}
    if r.collection != DEFAULT_COLLECTION:  # sidecars written before collections read as the default
        entry["collection"] = r.collection
    return entry


def load_index(directory: Path, *, dim: int, embedder_fingerprint: str) -> SavedIndex:
    """Read and verify the saved pair. Raises IndexLoadError for torn or corrupt files, another
    dimension, or (when both sides know it) vectors of another embedding model."""
    sidecar = sidecar_path(directory, STEM)
    body, blob = load_pair(directory, STEM)
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
        index = faiss.deserialize_index(np.frombuffer(blob, dtype=np.uint8))
        docs = {
            d: DocRange(int(r["start"]), int(r["count"]), dict(r["metadata"]),
                        str(r.get("collection", DEFAULT_COLLECTION)))
            for d, r in body["documents"].items()
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
