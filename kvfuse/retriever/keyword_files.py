"""The keyword index on disk: atomic save, verified load (the sealed-pair protocol of `sealed`).

Under its directory: `keyword-<generation>.npz` (every row's term ids and offsets, which rows are alive,
the vocabulary, and the base segment's bm25s matrix: its CSC data, indices and indptr) and the sidecar
`keyword.json` (documents' row ranges, the base's row count, the analyzer version and BM25 parameters
it was built with). The npz is read without pickle. A torn or corrupt pair, or one of another analyzer,
raises IndexLoadError: the caller rebuilds it from the stored documents' text. A base built with other
BM25 parameters is rebuilt from the saved rows at open (no text needed).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvfuse.retriever.errors import IndexLoadError
from kvfuse.retriever.keyword_segments import (
    ANALYZER_VERSION,
    KeywordState,
    RowRange,
    index_postings,
    set_base,
)
from kvfuse.retriever.sealed import load_pair, save_pair, sidecar_path

STEM = "keyword"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class SavedKeywords:
    state: KeywordState
    generation: int
    params: tuple[float, float]  # (k1, b) of the saved base


def is_saved(directory: Path) -> bool:
    return sidecar_path(directory, STEM).exists()


def save_keywords(directory: Path, state: KeywordState, *, k1: float, b: float, generation: int) -> int:
    arrays = {"tokens": state.tokens, "offsets": state.offsets, "alive": state.alive,
              "vocab": np.frombuffer("\n".join(state.terms).encode(), dtype=np.uint8)}
    if state.base is not None:
        arrays.update({f"base_{k}": np.asarray(state.base.scores[k]) for k in ("data", "indices", "indptr")})
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    body = {"format": FORMAT_VERSION, "analyzer": ANALYZER_VERSION, "k1": k1, "b": b,
            "rows": state.rows, "base_rows": state.base_rows, "terms": len(state.terms),
            "documents": {d: [rr.start, rr.count] for d, rr in state.docs.items()}}
    return save_pair(directory, STEM, "npz", buf.getbuffer(), body, generation)


def load_keywords(directory: Path) -> SavedKeywords:
    """Read and verify the saved pair; raises IndexLoadError (see the module doc)."""
    sidecar = sidecar_path(directory, STEM)
    body, blob = load_pair(directory, STEM)
    try:
        if body["format"] != FORMAT_VERSION or body["analyzer"] != ANALYZER_VERSION:
            raise IndexLoadError(f"{sidecar}: format {body['format']} / analyzer {body['analyzer']}, this version "
                                 f"reads {FORMAT_VERSION} / {ANALYZER_VERSION}: rebuild from the documents' text")
        with np.load(io.BytesIO(blob), allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
        vocab = bytes(arrays["vocab"]).decode()
        state = KeywordState(terms=vocab.split("\n") if vocab else [], tokens=arrays["tokens"].astype(np.int32),
                             offsets=arrays["offsets"].astype(np.int64), alive=arrays["alive"].astype(bool),
                             base_rows=int(body["base_rows"]))
        state.vocab = {t: i for i, t in enumerate(state.terms)}
        state.docs = {d: RowRange(int(s), int(c)) for d, (s, c) in body["documents"].items()}
        _check(state, body, sidecar)
        if "base_indptr" in arrays:
            set_base(state, _bm25(arrays, state))
        index_postings(state)
        return SavedKeywords(state, int(body["generation"]), (float(body["k1"]), float(body["b"])))
    except (KeyError, TypeError, ValueError, OSError) as err:
        raise IndexLoadError(f"{sidecar}: malformed ({type(err).__name__}: {err})") from err


def _check(state: KeywordState, body: dict, sidecar: Path) -> None:
    rows, terms = state.rows, len(state.terms)
    ok = (rows == body["rows"] and terms == body["terms"] and len(state.alive) == rows
          and 0 <= state.base_rows <= rows and int(state.offsets[-1]) == len(state.tokens)
          and bool(np.all(np.diff(state.offsets) >= 0))
          and (len(state.tokens) == 0 or 0 <= int(state.tokens.min()) <= int(state.tokens.max()) < terms)
          and all(0 <= rr.start and rr.start + rr.count <= rows and state.alive[rr.start : rr.start + rr.count].all()
                  for rr in state.docs.values())
          and sum(rr.count for rr in state.docs.values()) == state.live)
    if not ok:
        raise IndexLoadError(f"{sidecar}: the saved rows disagree with the sidecar ({rows} rows, {terms} terms)")


def _bm25(arrays: dict[str, np.ndarray], state: KeywordState):
    """The saved base as a bm25s index (the attributes bm25s.BM25.load sets)."""
    import bm25s

    base = bm25s.BM25(method="lucene")
    base.scores = {"data": arrays["base_data"], "indices": arrays["base_indices"],
                   "indptr": arrays["base_indptr"], "num_docs": state.base_rows}
    base.nonoccurrence_array = None
    if len(base.scores["indptr"]) - 1 > len(state.terms):
        raise ValueError("the base matrix has more term columns than the vocabulary")
    return base
