"""What an ingestion job is to the API process: its stored record (kvfuse.store.jobs) with what only
this process needs, and what a submission answers per document. The ids a document gets without one.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from typing import Any

from kvfuse.config import DEFAULT_COLLECTION
from kvfuse.store.jobs import JobRecord


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def default_doc_id(text: str, collection: str = DEFAULT_COLLECTION) -> str:
    """A missing id becomes the content hash (so re-sending the same text finds the same document), under
    its collection's name outside the default one (the same text may be a document of several)."""
    doc_id = "sha256-" + content_hash(text)[:32]
    return doc_id if collection == DEFAULT_COLLECTION else f"{collection}:{doc_id}"


@dataclass(eq=False)
class IngestJob:
    """A job's stored record plus what only this process needs (its end event, a pending cancel)."""

    rec: JobRecord
    cancelled: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)
    woken: asyncio.Event = field(default_factory=asyncio.Event)  # cuts a retry's pause short (a cancel)

    def __getattr__(self, name: str) -> Any:  # id, document_id, status, error, progress ... from the record
        return getattr(self.__dict__["rec"], name)


@dataclass(frozen=True)
class Submission:
    """One document of a submission: the job now ingesting it, or, when skipped, the job already on it or
    the stored document's status (`on_conflict: skip`)."""

    document_id: str
    job_id: str | None
    status: str
    skipped: bool | None = None
