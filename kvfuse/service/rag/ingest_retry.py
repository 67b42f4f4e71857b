"""Which ingestion failures pass, and how often and how patiently a job is tried again.

An accepted document must not be dropped for a failure that is not its own. Two pass by themselves:

- the worker died under the job (`WorkerCrashed`): the supervisor starts a new one at once, and the
  job's chunks already stored are not computed again. The document itself may be what kills the worker,
  so these are bounded by `server.ingest_retry_attempts`; after the last, the job fails with the reason
  and the worker, restarted, serves the rest.
- the document index (Redis) did not answer (`IndexUnavailableError` here, or the worker's
  `ERR_INDEX_UNAVAILABLE` when its blob write could not reach the index): LMDB, the source of truth, has
  whatever was written, so the job waits until the index answers again, within
  `server.ingest_index_attempts` tries, and goes on from what LMDB holds.

Every other failure is the document's (or a bug) and fails the job at once. A whole-server restart runs
unfinished jobs again anyway; the retries counted so far are stored with the job (`JobRecord.retries`),
so the bound holds across restarts too.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfuse.config import ServerSettings
from kvfuse.service.dispatch.job_book import WorkerCrashed, WorkerJobError
from kvfuse.service.wire import protocol as P
from kvfuse.store.errors import IndexUnavailableError

WORKER_CRASHED = "worker_crashed"
INDEX_UNAVAILABLE = "index_unavailable"


def cause_of(err: BaseException) -> str | None:
    """The passing cause of an ingestion failure (WORKER_CRASHED, INDEX_UNAVAILABLE), None if final."""
    if isinstance(err, WorkerCrashed):
        return WORKER_CRASHED
    if isinstance(err, IndexUnavailableError):
        return INDEX_UNAVAILABLE
    if isinstance(err, WorkerJobError) and err.kind == P.ERR_INDEX_UNAVAILABLE:
        return INDEX_UNAVAILABLE
    return None


@dataclass(frozen=True)
class RetryPolicy:
    """Tries in all per cause, and the pause before retry n (1-based): backoff_s doubling up to the max."""

    attempts: dict[str, int]
    backoff_s: float
    backoff_max_s: float

    @classmethod
    def from_settings(cls, server: ServerSettings) -> RetryPolicy:
        return cls({WORKER_CRASHED: server.ingest_retry_attempts, INDEX_UNAVAILABLE: server.ingest_index_attempts},
                   server.ingest_retry_backoff_s, server.ingest_retry_backoff_max_s)

    def pause(self, retry: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * 2 ** max(0, retry - 1))

    def exhausted(self, cause: str, tries: int) -> bool:
        """Whether `tries` failed tries of `cause` are all the policy allows."""
        return tries >= self.attempts[cause]
