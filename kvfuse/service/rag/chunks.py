"""Chunks as a reader sees them: the text a chunk covers, its document's metadata, and where in the file it
sits (page or section, for documents ingested from files). What citations (`sources`), `POST /v1/search`
and `GET /v1/documents/{id}/chunks` show; the tokens the model reads stay in the store.

A file's layout travels in its document's metadata (rag/files.py writes it): `page_starts` (a PDF: the
character offset each page starts at) or `section_starts` with `section_titles` (Markdown, HTML, DOCX:
where each heading's section starts). A chunk is on the page, or in the section, where its first character
is. See docs/usage.md, Files.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfuse.retriever.hybrid import RankedHit
    from kvfuse.service.rag.corpus import Corpus
    from kvfuse.store import DocumentRecord

LAYOUT_KEYS = ("page_starts", "section_starts", "section_titles")


@dataclass
class FoundChunk:
    """One chunk with its text and its document's metadata; `score` and the ranks when retrieved."""

    document_id: str
    chunk_index: int
    text: str
    tokens: int
    metadata: dict[str, Any]
    location: dict[str, Any] = field(default_factory=dict)
    score: float = 1.0
    dense_rank: int | None = None
    keyword_rank: int | None = None


def chunk_location(metadata: dict[str, Any], start: int) -> dict[str, Any]:
    """{"page": n} (from 1) or {"section": title, "section_index": i} (from 0) of the character `start`,
    from the layout a file left in `metadata`; {} for a document sent as text."""
    pages = metadata.get("page_starts")
    if isinstance(pages, list) and pages:
        return {"page": max(1, bisect.bisect_right(pages, start))}
    starts, titles = metadata.get("section_starts"), metadata.get("section_titles")
    if isinstance(starts, list) and isinstance(titles, list) and starts:
        i = bisect.bisect_right(starts, start) - 1
        if i >= 0:
            return {"section": titles[i], "section_index": i}
    return {}


def reader_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """The document's metadata without the layout lists (the chunk's own page or section says it)."""
    return {k: v for k, v in metadata.items() if k not in LAYOUT_KEYS}


def document_chunks(corpus: Corpus, rec: DocumentRecord) -> list[FoundChunk]:
    """Every chunk of a ready document, in order. Reads the store: call it in a thread."""
    texts = corpus.chunk_texts(rec)
    meta = reader_metadata(rec.metadata)
    out, start = [], 0
    for i, (text, n) in enumerate(zip(texts, rec.chunk_tokens, strict=True)):
        out.append(FoundChunk(rec.id, i, text, n, meta, chunk_location(rec.metadata, start)))
        start += len(text)
    return out


def found_chunks(corpus: Corpus, hits: list[RankedHit]) -> list[FoundChunk]:
    """The retrieved hits as chunks, best first; a hit whose document was deleted or re-ingested since the
    search is left out. Reads the store: call it in a thread."""
    chunks: dict[str, list[FoundChunk]] = {}
    out = []
    for h in hits:
        if h.document_id not in chunks:
            rec = corpus.store.get_document(h.document_id)
            chunks[h.document_id] = document_chunks(corpus, rec) if rec is not None and rec.status == "ready" else []
        if h.chunk_index >= len(chunks[h.document_id]):
            continue
        c = dataclasses.replace(chunks[h.document_id][h.chunk_index], score=h.score, dense_rank=h.dense_rank,
                                keyword_rank=h.keyword_rank)
        out.append(c)
    return out
