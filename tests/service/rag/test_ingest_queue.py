"""The ingestion queue (kvfuse/service/rag/ingest_queue.py) through `IngestManager.submit_all` on a real
LMDB store, its runner not started: a job per document is counted (a batch's too), the queue and each API
key's share of it are bounds answered 429 with Retry-After before anything is stored, the keys' jobs come
out in turn, and a waiting job holds its text in LMDB only."""

from __future__ import annotations

import asyncio

import pytest

from kvfuse.service.errors import APIError
from kvfuse.service.metrics import Metrics
from kvfuse.service.rag.corpus import Corpus
from kvfuse.service.rag.ingest import IngestManager
from kvfuse.service.rag.ingest_queue import SERVICE
from kvfuse.store import KVStore


@pytest.fixture
def manager(settings_factory):
    settings = settings_factory(redis_url="", server={"ingest_queue_size": 8, "ingest_queue_key_share": 0.5,
                                                      "retry_after_s": 3})
    with KVStore.open(settings) as store:
        ingest = IngestManager(settings, Metrics(), dispatcher=None)
        ingest.attach(Corpus(settings, store))
        yield ingest


def _docs(prefix: str, n: int) -> list[tuple[str, str, dict, str, str]]:
    return [(f"{prefix}{i}", f"The text of {prefix}{i}.", {}, "skip", "default") for i in range(n)]


def _stored_jobs(ingest: IngestManager) -> int:
    return len(ingest.corpus.store.jobs.unfinished())


def test_each_key_may_fill_its_share_and_the_queue_its_size(manager: IngestManager) -> None:
    async def run() -> None:
        manager.submit_all(_docs("a", 3), "key-a")
        with pytest.raises(APIError) as caught:
            manager.submit_all(_docs("a-more", 2), "key-a")  # a batch of 2: 5 > the key's 4
        err = caught.value
        assert (err.status, err.code, err.headers) == (429, "ingest_queue_full", {"Retry-After": "3"})
        assert "server.ingest_queue_key_share" in err.message
        assert _stored_jobs(manager) == 3  # the refused batch stored nothing
        manager.submit_all(_docs("a-last", 1), "key-a")
        manager.submit_all(_docs("b", 4), "key-b")  # key-a's flood left key-b its share
        with pytest.raises(APIError) as caught:
            manager.check_room("key-c")
        assert caught.value.status == 429 and "server.ingest_queue_size" in caught.value.message
        manager.submit_all(_docs("rebuild", 2), SERVICE)  # the service's own jobs are always admitted
        assert _stored_jobs(manager) == 10
        with pytest.raises(APIError) as caught:
            manager.check_room("key-d", 5)  # more than a key may ever queue: not worth retrying
        assert (caught.value.status, caught.value.code) == (413, "batch_too_large")

    asyncio.run(run())


def test_the_keys_jobs_come_out_in_turn_and_wait_without_their_text(manager: IngestManager) -> None:
    async def run() -> None:
        submitted = [job for job, _ in manager.submit_all(_docs("a", 4), "key-a")]
        submitted += [job for job, _ in manager.submit_all(_docs("b", 2), "key-b")]
        for job in submitted:
            assert job.rec.text == ""  # in memory: nothing of the document
            assert manager.corpus.store.jobs.get(job.id).text == f"The text of {job.document_id}."  # in LMDB
        manager.cancel("a1")  # a cancelled job leaves the queue and its place
        order = [(await manager._queue.get()).document_id for _ in range(5)]
        assert order == ["a0", "b0", "a2", "b1", "a3"]
        assert len(manager._queue) == 0

    asyncio.run(run())
