"""The ingestion jobs waiting for the runner: bounded, and shared fairly between API keys.

One runner ingests one document at a time (the worker is the bottleneck), so under a flood jobs wait.
Unbounded, that wait held every queued job in memory and no client was ever told to slow down. Here at
most `server.ingest_queue_size` jobs wait (a job per document: a batch of 40 takes 40 places), and one API
key's jobs at most `server.ingest_queue_key_share` of them, so a key flooding the service leaves room for
the others; a request that would pass either bound is answered 429 `ingest_queue_full` with
`Retry-After` before anything is stored. The runner takes the keys' jobs in turn (round robin over the
keys with jobs waiting, each key's in the order sent), so a key's one document does not wait behind
another key's thousand. A waiting job holds its record without its text: the text is in LMDB (the job is
durable before the 202), read back when the job starts (ingest.py). Jobs the service queues itself (a
restart's unfinished ones, rebuilds for another model) are admitted always: they are bounded by the
documents stored. See docs/DESIGN.md, "Bounded under load".
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict, deque
from typing import TYPE_CHECKING

from kvfuse.service.errors import APIError

if TYPE_CHECKING:
    from kvfuse.config import ServerSettings
    from kvfuse.service.rag.ingest_job import IngestJob

SERVICE = ""  # the owner of the jobs the service queues itself


class IngestQueue:
    def __init__(self, server: ServerSettings) -> None:
        self.size = server.ingest_queue_size
        self.key_size = max(1, math.floor(server.ingest_queue_size * server.ingest_queue_key_share))
        self.retry_after_s = max(1, server.retry_after_s)
        self._waiting: OrderedDict[str, deque[IngestJob]] = OrderedDict()  # owner -> its jobs, in turn order
        self._count = 0
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return self._count

    def waiting(self, owner: str) -> int:
        return len(self._waiting.get(owner, ()))

    def check_room(self, owner: str, n: int) -> None:
        """429 unless `n` more jobs of `owner` fit now (the service's own always do)."""
        if owner == SERVICE:
            return
        if n > self.key_size:
            raise APIError(413, f"{n} documents are more than one API key may queue for ingestion "
                                f"({self.key_size}: server.ingest_queue_size x server.ingest_queue_key_share)",
                           code="batch_too_large", param="documents")
        mine = self.waiting(owner)
        if self._count + n > self.size:
            why = (f"the ingestion queue is full ({self._count} of server.ingest_queue_size = {self.size} "
                   "documents waiting)")
        elif mine + n > self.key_size:
            why = (f"this API key has {mine} documents waiting for ingestion, and may have "
                   f"{self.key_size} (server.ingest_queue_key_share of the queue)")
        else:
            return
        raise APIError(429, f"{why}; retry later", code="ingest_queue_full",
                       headers={"Retry-After": str(self.retry_after_s)})

    def put(self, job: IngestJob, owner: str) -> None:
        self._waiting.setdefault(owner, deque()).append(job)
        self._count += 1
        self._changed.set()

    def discard(self, job: IngestJob) -> None:
        """Take a job out before its turn (cancelled while waiting)."""
        for owner, jobs in self._waiting.items():
            if job in jobs:
                jobs.remove(job)
                self._count -= 1
                if not jobs:
                    del self._waiting[owner]
                return

    async def get(self) -> IngestJob:
        """The next job: the oldest of the key whose turn it is; that key goes to the back of the turn."""
        while not self._waiting:
            self._changed.clear()
            await self._changed.wait()
        owner, jobs = next(iter(self._waiting.items()))
        job = jobs.popleft()
        self._count -= 1
        del self._waiting[owner]
        if jobs:
            self._waiting[owner] = jobs  # back of the turn order
        return job
