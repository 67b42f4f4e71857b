"""The keyword index in memory: a bm25s base segment, a fresh segment beside it, and the merge between them.

A bm25s index is built once over a fixed corpus (its matrix holds each term's BM25 score in each chunk,
with the corpus statistics baked in) and cannot take a chunk in or out. Rebuilding it on every ingest
would cost time in proportion to the whole corpus, so the chunks live in two segments, as in Lucene:

- **base**: rows [0, base_rows), scored by bm25s with the statistics of its build;
- **fresh**: the rows added since, scored here with the same BM25 formula (Lucene's idf and term-frequency
  parts, bm25s's `lucene` method) over the statistics of all rows, from in-memory postings.

A removed or overwritten document's rows stay where they are, marked dead (`alive`), and are masked at
query time; like Lucene's deleted documents they still count in the statistics until the next merge. A
merge (`merged`) rebuilds the base from the live rows alone (dropping unused terms from the vocabulary)
once fresh and dead rows together pass a share of the index; its cost is spread over the chunks that made
it necessary, so ingestion pays a bounded amount per chunk on average.

Row arrays are replaced, never written in place, so a merge can build from a snapshot without a lock.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvfuse.retriever.results import Hit

# The analyzer: lower case, words of two or more letters or digits (bm25s's default pattern), English
# stopwords out, no stemming. Part of the saved index: a change makes saved indexes rebuild from text.
ANALYZER_VERSION = 1
_WORD = re.compile(r"(?u)\b\w\w+\b")


def _stopwords() -> frozenset[str]:
    from bm25s.stopwords import STOPWORDS_EN

    return frozenset(STOPWORDS_EN)


STOPWORDS = _stopwords()


def analyze(text: str) -> list[str]:
    """The terms of `text`, in order, repeats kept (their counts are the term frequencies)."""
    return [w for w in _WORD.findall(text.lower()) if w not in STOPWORDS]


@dataclass(frozen=True)
class RowRange:
    """A document's chunks: rows [start, start + count), chunk i in row start + i."""

    start: int
    count: int


@dataclass
class KeywordState:
    """Everything a save writes (postings and base document frequencies are derived from it)."""

    terms: list[str] = field(default_factory=list)  # term id -> term
    vocab: dict[str, int] = field(default_factory=dict)  # term -> term id
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))  # every row's term ids
    offsets: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64))  # row r: [offsets[r], [r+1])
    alive: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    docs: dict[str, RowRange] = field(default_factory=dict)
    base_rows: int = 0
    base: Any = None  # bm25s.BM25 over rows [0, base_rows); None when they hold no term
    base_df: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # per term id, in the base
    postings: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)  # fresh: term -> (rows, tfs)
    _starts: tuple[np.ndarray, list[str]] | None = None  # documents by first row, for row -> document

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1

    @property
    def live(self) -> int:
        return int(self.alive.sum())

    @property
    def dead(self) -> int:
        return self.rows - self.live

    @property
    def fresh(self) -> int:
        return self.rows - self.base_rows

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def add_rows(state: KeywordState, doc_id: str, chunks: list[list[str]]) -> None:
    """Append a document's chunks (each a list of terms) as fresh rows; an indexed document of the same id
    is removed first."""
    remove_rows(state, doc_id)
    start = state.rows
    ids: list[int] = []
    ends: list[int] = []
    for row, chunk in enumerate(chunks, start):
        chunk_ids = [_term_id(state, t) for t in chunk]
        for term_id, tf in Counter(chunk_ids).items():
            rows, tfs = state.postings.setdefault(term_id, ([], []))
            rows.append(row)
            tfs.append(tf)
        ids.extend(chunk_ids)
        ends.append(len(state.tokens) + len(ids))
    state.tokens = np.concatenate([state.tokens, np.asarray(ids, dtype=np.int32)])
    state.offsets = np.concatenate([state.offsets, np.asarray(ends, dtype=np.int64)])
    state.alive = np.concatenate([state.alive, np.ones(len(chunks), dtype=bool)])
    state.docs[doc_id] = RowRange(start, len(chunks))
    state._starts = None


def _term_id(state: KeywordState, term: str) -> int:
    term_id = state.vocab.get(term)
    if term_id is None:
        term_id = state.vocab[term] = len(state.terms)
        state.terms.append(term)
    return term_id


def remove_rows(state: KeywordState, doc_id: str) -> int:
    """Mark a document's rows dead; returns how many (0 if it was not indexed)."""
    rr = state.docs.pop(doc_id, None)
    if rr is None:
        return 0
    alive = state.alive.copy()
    alive[rr.start : rr.start + rr.count] = False
    state.alive = alive
    state._starts = None
    return rr.count


def needs_merge(state: KeywordState, ratio: float, min_rows: int) -> bool:
    return state.fresh + state.dead > max(min_rows, ratio * state.rows)


def merged(state: KeywordState, k1: float, b: float) -> KeywordState:
    """A new state holding `state`'s live rows, all in a rebuilt base (fresh and dead rows gone, term ids
    renumbered over the terms still used). Reads `state` only: callers may run it without their lock."""
    live = np.flatnonzero(state.alive)
    lengths = state.lengths()[live]
    starts = state.offsets[:-1][live]
    # The live rows' token positions, in order: each row's start repeated over its length, plus 0, 1, ...
    firsts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(live) else np.zeros(0, np.int64)
    pos = np.repeat(starts - firsts, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)
    used, tokens = np.unique(state.tokens[pos], return_inverse=True)
    new = KeywordState(terms=[state.terms[i] for i in used], tokens=tokens.astype(np.int32),
                       offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                       alive=np.ones(len(live), dtype=bool), base_rows=len(live))
    new.vocab = {t: i for i, t in enumerate(new.terms)}
    new_row = np.full(state.rows, -1, dtype=np.int64)
    new_row[live] = np.arange(len(live))
    new.docs = {d: RowRange(int(new_row[rr.start]), rr.count) for d, rr in state.docs.items()}
    build_base(new, k1, b)
    return new


def build_base(state: KeywordState, k1: float, b: float) -> None:
    """Index rows [0, base_rows) with bm25s (every term id of the vocabulary is a column)."""
    import bm25s

    n, o = state.base_rows, state.offsets
    state.base, state.base_df = None, np.zeros(len(state.terms), dtype=np.int64)
    if n == 0 or not state.terms:
        return
    corpus = [state.tokens[o[r] : o[r + 1]].tolist() for r in range(n)]
    base = bm25s.BM25(k1=k1, b=b, method="lucene")
    base.scores = base.build_index_from_ids(list(range(len(state.terms))), corpus, show_progress=False)
    set_base(state, base)


def set_base(state: KeywordState, base: Any) -> None:
    state.base = base
    state.base_df = np.diff(base.scores["indptr"]).astype(np.int64)  # entries per term column = its df


def index_postings(state: KeywordState) -> None:
    """The fresh rows' postings, from their tokens (after a load or a merge)."""
    state.postings = {}
    o = state.offsets
    for row in range(state.base_rows, state.rows):
        for term_id, tf in Counter(state.tokens[o[row] : o[row + 1]].tolist()).items():
            rows, tfs = state.postings.setdefault(term_id, ([], []))
            rows.append(row)
            tfs.append(tf)


def scores(state: KeywordState, term_ids: list[int], k1: float, b: float) -> np.ndarray:
    """BM25 of every row for these (distinct) query terms: base rows by bm25s, fresh rows here."""
    out = np.zeros(state.rows, dtype=np.float32)
    if state.base is not None:
        in_base = [t for t in term_ids if t < len(state.base_df)]
        if in_base:
            out[: state.base_rows] = state.base.get_scores_from_ids(in_base)
    if not state.postings or state.rows == 0:
        return out
    n = state.rows
    lengths = state.lengths()
    avgdl = max(float(state.offsets[-1]) / n, 1e-9)
    for t in term_ids:
        posting = state.postings.get(t)
        if posting is None:
            continue
        rows = np.asarray(posting[0], dtype=np.int64)
        tf = np.asarray(posting[1], dtype=np.float64)
        df = len(rows) + (int(state.base_df[t]) if t < len(state.base_df) else 0)
        idf = math.log(1.0 + (n - df + 0.5) / (df + 0.5))
        norm = k1 * (1.0 - b + b * lengths[rows] / avgdl)
        out[rows] += (idf * tf / (tf + norm)).astype(np.float32)
    return out


def top_rows(values: np.ndarray, mask: np.ndarray, k: int) -> np.ndarray:
    """Up to k rows with the highest positive value among `mask`, best first (ties: lower row first)."""
    candidates = np.flatnonzero(mask & (values > 0))
    if len(candidates) > k:
        part = np.argpartition(-values[candidates], k - 1)[:k]
        candidates = np.sort(candidates[part])
    order = np.argsort(-values[candidates], kind="stable")
    return candidates[order]


def hits(state: KeywordState, rows: np.ndarray, values: np.ndarray) -> list[Hit]:
    """Rows as (document, chunk index, score), through the documents' sorted first rows."""
    if state._starts is None:
        pairs = sorted((rr.start, d) for d, rr in state.docs.items())
        state._starts = (np.asarray([s for s, _ in pairs], dtype=np.int64), [d for _, d in pairs])
    keys, names = state._starts
    pos = np.searchsorted(keys, rows, side="right") - 1
    return [Hit(names[p], row - int(keys[p]), float(values[row]))
            for row, p in zip(rows.tolist(), pos.tolist(), strict=True)]
