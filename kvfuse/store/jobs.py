"""Durable ingestion jobs, and the staged version of a document they build beside the stored one.

A job is written to LMDB (`jobs`: job id -> JSON `JobRecord`, with the document's text) before the API
answers 202, so a restart finds every unfinished job and runs it again from its text. While it runs, the
chunk keys of the version it builds are referenced under the job's own owner id (`~<job id>`, which no
document id can be: ids start with a letter or digit), so those blobs are neither orphans nor taken away
by a delete of another document; the stored version of the document is untouched and keeps answering.
`commit` swaps the new version in: the document record, its text, its chunk refs, the release of the
staged refs and the job's new status are one LMDB transaction. `abandon` releases the staged refs (the
blobs only the job used go with them) and records why. See docs/DESIGN.md, Durability.

Finished jobs are kept for `server.job_history_s` (`purge`), so a job id keeps answering after a restart.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import lmdb

from kvfuse.config import DEFAULT_COLLECTION
from kvfuse.store.catalog import DocumentCatalog
from kvfuse.store.lmdb_env import LmdbEnv
from kvfuse.store.records import STAGING_PREFIX, DocumentRecord

FINISHED = ("ready", "failed", "cancelled")


def public_status(status: str) -> str:
    """What the API shows: `indexing` is a step of `processing`."""
    return "processing" if status == "indexing" else status


def staging_owner(job_id: str) -> str:
    return STAGING_PREFIX + job_id


@dataclass
class JobRecord:
    id: str
    document_id: str
    status: str = "pending"  # pending | processing | indexing | ready | failed | cancelled
    error: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    collection: str = DEFAULT_COLLECTION
    text: str = ""  # kept until the job finishes: a restart runs the job again from it
    created_at: float = 0.0
    updated_at: float = 0.0
    chunks_total: int = 0
    chunks_done: int = 0
    staged_keys: list[str] = field(default_factory=list)  # chunk keys referenced under staging_owner(id)
    worker_crashed: bool = False
    # Retries so far per passing cause (kvfuse/service/rag/ingest_retry.py), stored so their bound holds
    # across restarts; and, while the job pauses before its next try, what it waits for.
    retries: dict[str, int] = field(default_factory=dict)
    waiting_for: str | None = None
    precompute_at: str = ""  # the request's `precompute_at` ("" = store.precompute_at)

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes | memoryview) -> JobRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(bytes(raw)).items() if k in names})


def _take(job: JobRecord, written: JobRecord) -> None:
    """The in-memory job takes its record as just written. The API reads the in-memory job while a
    thread writes its next state, so each change is written first (`written`, a copy) and taken after:
    a poll never reads a state LMDB does not hold yet (a job `failed` before its document's `failed`
    record)."""
    for f in fields(JobRecord):
        setattr(job, f.name, getattr(written, f.name))


class JobStore:
    """The `jobs` database and the staged chunk refs of each unfinished job."""

    def __init__(self, env: LmdbEnv, catalog: DocumentCatalog) -> None:
        self.env = env
        self.catalog = catalog
        self._jobs = env.db("jobs")

    # --- reads
    def get(self, job_id: str) -> JobRecord | None:
        if self._jobs is None:
            return None
        with self.env.read() as txn:
            raw = txn.get(job_id.encode(), db=self._jobs)
            return None if raw is None else JobRecord.from_json(raw)

    def all(self, txn: lmdb.Transaction | None = None) -> list[JobRecord]:
        """Every job, oldest first."""
        if txn is None:
            with self.env.read() as t:
                return self.all(t)
        if self._jobs is None:  # an older store, opened read-only
            return []
        jobs = [JobRecord.from_json(v) for _, v in txn.cursor(db=self._jobs)]
        return sorted(jobs, key=lambda j: (j.created_at, j.id))

    def unfinished(self) -> list[JobRecord]:
        return [j for j in self.all() if not j.finished]

    def staged_refs(self, txn: lmdb.Transaction) -> set[tuple[str, str]]:
        """(chunk key, owner) of every unfinished job's staged refs (what `kvfuse store check` expects)."""
        return {(k, staging_owner(j.id)) for j in self.all(txn) if not j.finished for k in j.staged_keys}

    # --- writes
    def put(self, job: JobRecord) -> None:
        """Create or update a job record (status, progress): one small transaction."""
        job.updated_at = time.time()
        job.created_at = job.created_at or job.updated_at
        self.env.write(lambda txn: txn.put(job.id.encode(), job.to_json(), db=self._jobs))

    def put_many(self, jobs: list[JobRecord]) -> None:
        """Store new jobs in one transaction (a batch ingest is one commit, not one per document)."""
        now = time.time()
        for job in jobs:
            job.created_at, job.updated_at = job.created_at or now, now

        def fn(txn: lmdb.Transaction) -> None:
            for job in jobs:
                txn.put(job.id.encode(), job.to_json(), db=self._jobs)

        self.env.write(fn)

    def stage(self, job: JobRecord, keys: list[str]) -> None:
        """Reference `keys` under the job (before their blobs are written), releasing what it staged
        before and no longer needs (a restarted job whose chunks changed)."""
        owner = staging_owner(job.id)
        old = list(job.staged_keys)
        job.staged_keys = list(dict.fromkeys(keys))
        job.updated_at = time.time()

        def fn(txn: lmdb.Transaction) -> list[str]:
            self.catalog.add_refs(txn, owner, [k for k in job.staged_keys if k not in old])
            txn.put(job.id.encode(), job.to_json(), db=self._jobs)
            return self.catalog.release_refs(txn, owner, [k for k in old if k not in job.staged_keys])

        self.catalog.write_releasing(fn)

    def commit(self, job: JobRecord, doc: DocumentRecord, text: str, status: str = "indexing") -> None:
        """Swap the staged version in: the document (record, text, refs), the release of the staged
        refs and the job's status, in one transaction."""
        owner, staged = staging_owner(job.id), list(job.staged_keys)
        swapped = replace(job, status=status, error=None, staged_keys=[], updated_at=time.time())

        def also(txn: lmdb.Transaction) -> list[str]:
            txn.put(swapped.id.encode(), swapped.to_json(), db=self._jobs)
            return self.catalog.release_refs(txn, owner, staged)

        try:
            self.catalog.put_document(doc, text, also=also)
        finally:  # (also when the index's copy failed after the LMDB write)
            _take(job, swapped)

    def abandon(self, job: JobRecord, status: str, error: str | None,
                failed_doc: DocumentRecord | None = None) -> None:
        """End the job without swapping: release its staged refs, record `status` and `error`, and write
        `failed_doc` (a document that had no good version records why) in the same transaction."""
        owner, staged, text = staging_owner(job.id), list(job.staged_keys), job.text
        ended = replace(job, status=status, error=error, staged_keys=[], text="", updated_at=time.time())

        def also(txn: lmdb.Transaction) -> list[str]:
            txn.put(ended.id.encode(), ended.to_json(), db=self._jobs)
            return self.catalog.release_refs(txn, owner, staged)

        try:
            if failed_doc is not None:
                self.catalog.put_document(failed_doc, text or None, also=also)
            else:
                self.catalog.write_releasing(also)
        finally:  # (also when the index's copy failed after the LMDB write: the job has ended either way)
            _take(job, ended)

    def finish(self, job: JobRecord, status: str = "ready") -> None:
        """The last step of a committed job: its status, and its text (now the document's) dropped."""
        ended = replace(job, status=status, text="")
        self.put(ended)
        _take(job, ended)

    def purge(self, older_than_s: float) -> int:
        """Delete finished jobs last updated more than `older_than_s` ago; returns how many."""
        cutoff = time.time() - older_than_s

        def fn(txn: lmdb.Transaction) -> int:
            old = [j.id for j in self.all(txn) if j.finished and j.updated_at < cutoff]
            for job_id in old:
                txn.delete(job_id.encode(), db=self._jobs)
            return len(old)

        with self.env.read() as txn:
            if not any(j.finished and j.updated_at < cutoff for j in self.all(txn)):
                return 0
        return self.env.write(fn)
