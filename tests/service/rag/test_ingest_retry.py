"""Nothing accepted is dropped for a failure that is not the document's (kvfuse/service/rag/ingest_retry.py),
over real HTTP with a real worker process, a real LMDB store and a real redis-server:

- the worker SIGKILLed in the middle of an ingestion: the job says it retries, runs again on the new
  worker and ends `ready`, with the version sent;
- a document whose ingestion the worker dies under every time ends `failed` after the last allowed
  try, with the reason, and the new worker serves the rest;
- the document index (a private redis-server) SIGKILLed in the middle of an ingestion: the job says it
  waits for the index, never `failed`, and ends `ready` once Redis is back (empty: rebuilt from LMDB);
- a query naming a document that is still being ingested is told 409, not ready yet, with Retry-After;
- an answer names its worker as /ready does.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from redis_server import free_port, start_redis
from service_helpers import (
    API_KEY,
    ServerProcess,
    make_client,
    sha,
    until,
    wait_job,
    wait_progress,
    worker_pid,
)

pytestmark = pytest.mark.slow

ENV = {"KVFUSE_SERVER__API_KEYS": API_KEY, "KVFUSE_RETRIEVER__CHUNK_TOKENS": "128",
       "KVFUSE_MODEL__MAX_CONTEXT_TOKENS": "1024", "KVFUSE_GENERATION__MAX_TOKENS": "4",
       "KVFUSE_SERVER__PRECOMPUTE_BATCH_CHUNKS": "1", "KVFUSE_SERVER__INGEST_RETRY_ATTEMPTS": "2",
       "KVFUSE_SERVER__INGEST_RETRY_BACKOFF_S": "0.5", "KVFUSE_SERVER__INGEST_RETRY_BACKOFF_MAX_S": "1"}


@pytest.fixture(scope="module")
def big(essays: list[tuple[str, str]]) -> str:
    return "\n\n".join(t for _, t in essays[:2])[:4000]  # about 8 chunks of 128 tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("ingest-retry")
    s = ServerProcess(root / "data", root / "server.log", **ENV).start()
    try:
        yield s
    finally:
        s.stop()


def _submit(c: httpx.Client, doc_id: str, text: str) -> str:
    resp = c.post("/v1/documents", json={"id": doc_id, "text": text, "metadata": {"name": doc_id}})
    assert resp.status_code == 202, resp.text
    return resp.json()["job_id"]


def _job_when(c: httpx.Client, job_id: str, predicate) -> dict | None:
    """The job's JSON if `predicate` holds for it now, else None (for `until`)."""
    job = c.get(f"/v1/jobs/{job_id}").json()
    return job if predicate(job) else None


def _answers(c: httpx.Client, doc_id: str) -> None:
    """The document answers (retrieved by its metadata: a long one does not fit the context whole)."""
    resp = c.post("/v1/query", json={"query": "What is this about?", "filters": {"name": doc_id}, "top_k": 2,
                                     "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    assert {s["document_id"] for s in resp.json()["sources"]} == {doc_id}


def test_a_query_naming_a_document_being_ingested_is_told_to_retry(server: ServerProcess, big: str) -> None:
    with make_client(server) as c:
        job_id = _submit(c, "early", big[:1500])
        assert c.get("/v1/documents/early").json()["status"] in ("pending", "processing")
        resp = c.post("/v1/query", json={"query": "What is it about?", "document_ids": ["early"]})
        assert resp.status_code == 409, resp.text
        err = resp.json()["error"]
        assert err["code"] == "document_not_ready" and err["param"] == "document_ids" and job_id in err["message"]
        assert int(resp.headers["retry-after"]) >= 1
        missing = c.post("/v1/query", json={"query": "What is it about?", "document_ids": ["never-sent"]})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "document_not_found"
        assert wait_job(c, job_id)["status"] == "ready"
        assert c.delete("/v1/documents/early").status_code == 200


def test_a_worker_crash_mid_ingest_is_retried_and_the_document_ends_ready(server: ServerProcess, big: str) -> None:
    with make_client(server) as c:
        job_id = _submit(c, "crash-once", big)
        wait_progress(c, job_id, 2)
        victim = worker_pid(c)
        os.kill(victim, signal.SIGKILL)
        seen = until(lambda: _job_when(c, job_id, lambda j: j["status"] != "processing" or j.get("retries")), 60,
                     "the job never said it retries")
        assert seen["status"] == "processing" and seen["retries"] == {"worker_crashed": 1}, seen
        job = wait_job(c, job_id)
        assert job["status"] == "ready" and job["error"] is None and job["retries"] == {"worker_crashed": 1}, job
        assert "waiting_for" not in job
        doc = c.get("/v1/documents/crash-once").json()
        assert doc["status"] == "ready" and doc["content_hash"] == sha(big) and doc["chunks"] == job["progress"]["chunks_total"]
        assert worker_pid(c) not in (None, victim)
        _answers(c, "crash-once")


def test_a_document_that_crashes_the_worker_every_time_fails_after_the_last_try(server: ServerProcess,
                                                                                big: str, essays3) -> None:
    """Every try of the job gets its worker killed (2 tries allowed): the job ends `failed` with the
    reason, the new document has a `failed` record saying why, and the next worker serves the rest."""
    with make_client(server) as c:
        job_id = _submit(c, "poison", big[:3000])
        killed: set[int] = set()
        while (job := c.get(f"/v1/jobs/{job_id}").json())["status"] == "processing":
            pid = worker_pid(c)
            trying = not job.get("waiting_for") and job["progress"]["chunks_done"] >= 1
            if trying and pid is not None and pid not in killed:  # each try is killed by its own worker
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
        assert len(killed) >= 2  # (one more if a kill fell between two precompute batches, with none in flight)
        assert job["status"] == "failed" and job["retries"] == {"worker_crashed": 1}, job
        assert "worker crashed during KV precompute" in job["error"] and "after 2 attempts" in job["error"], job
        doc = c.get("/v1/documents/poison").json()
        assert doc.get("status") == "failed" and doc.get("error") == job["error"], doc
        server.wait_ready()  # the worker survives: restarted, it serves the rest
        assert wait_job(c, _submit(c, "after", essays3["todo"][:1200]))["status"] == "ready"
        _answers(c, "after")


def test_an_answer_names_its_worker_as_ready_does(server: ServerProcess, essays3) -> None:
    with make_client(server) as c:
        assert wait_job(c, _submit(c, "nft", essays3["nft"][:1200]))["status"] == "ready"
        answer = c.post("/v1/query", json={"query": "What are NFTs?", "document_ids": ["nft"], "max_tokens": 2})
        assert answer.status_code == 200, answer.text
        workers = c.get("/ready").json()["workers"]
        assert [w["id"] for w in workers] == [answer.json()["worker"]]
        assert workers[0]["pid"] == worker_pid(c)


def test_an_index_outage_mid_ingest_waits_for_redis_and_ends_ready(tmp_path, big: str) -> None:
    port = free_port()
    redis_proc = start_redis(port, tmp_path)
    server = ServerProcess(tmp_path / "data", tmp_path / "server.log", KVFUSE_REDIS_URL=f"redis://127.0.0.1:{port}/0",
                           KVFUSE_STORE__REDIS_TIMEOUT_S="1", KVFUSE_SERVER__INGEST_INDEX_ATTEMPTS="200", **ENV)
    try:
        server.start()
        with make_client(server) as c:
            job_id = _submit(c, "outage", big)
            wait_progress(c, job_id, 2)
            redis_proc.kill()
            redis_proc.wait(10)
            waiting = until(lambda: _job_when(c, job_id, lambda j: j["status"] != "processing" or j.get("waiting_for")),
                            120, "the job never said it waits for the index")
            assert waiting["status"] == "processing" and "document index" in waiting["waiting_for"], waiting
            for _ in range(8):  # Redis stays down a while: the job keeps waiting, it does not fail
                job = c.get(f"/v1/jobs/{job_id}").json()
                assert job["status"] == "processing" and job["waiting_for"], job
                time.sleep(1)
            redis_proc = start_redis(port, tmp_path)  # back, and empty
            job = wait_job(c, job_id)
            assert job["status"] == "ready" and job["retries"]["index_unavailable"] >= 1, job
            doc = c.get("/v1/documents/outage")  # the index was rebuilt from LMDB
            assert doc.status_code == 200 and doc.json()["status"] == "ready", doc.text
            assert doc.json()["content_hash"] == sha(big)
            _answers(c, "outage")
    finally:
        server.stop()
        redis_proc.kill()
        redis_proc.wait(10)
    assert "could not record" not in server.log_path.read_text()
