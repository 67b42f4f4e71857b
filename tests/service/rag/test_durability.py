"""Nothing lost, nothing stale, over real HTTP with real processes and a real LMDB store: queued ingests
survive a restart, a failed overwrite keeps the good version, a delete during an overwrite wins, a
`?wait=true` that times out says where to look, a model change never reuses the old model's KV, and the
open probes keep details for a valid key. The tests run in file order on one data dir (the last ones
restart the server)."""

from __future__ import annotations

import hashlib
import os
import signal
import time

import httpx
import pytest
from service_helpers import (
    API_KEY,
    Holder,
    ServerProcess,
    make_client,
    metric,
    retuned_default_model,
    serving,
    store_check,
    wait_job,
    wait_progress,
)

pytestmark = pytest.mark.slow

SERVER_ENV = {
    "KVFUSE_SERVER__API_KEYS": API_KEY,
    "KVFUSE_RETRIEVER__CHUNK_TOKENS": "128",
    "KVFUSE_MODEL__MAX_CONTEXT_TOKENS": "1024",
    "KVFUSE_GENERATION__MAX_TOKENS": "4",
    "KVFUSE_SERVER__INGEST_WAIT_TIMEOUT_S": "1",  # `big` takes far longer
    "KVFUSE_SERVER__PRECOMPUTE_BATCH_CHUNKS": "2",
    # Each chunk alone: what is durable does not depend on what a chunk is computed after, and the
    # default (its document before it) made ingesting `big` about nine times slower here
    # (what it computes is tested in test_precompute_context_http.py).
    "KVFUSE_STORE__PRECOMPUTE_CONTEXT": "none",
    # One try: a worker crash fails the ingestion at once (its retries: test_ingest_retry.py).
    "KVFUSE_SERVER__INGEST_RETRY_ATTEMPTS": "1",
}


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.fixture(scope="module")
def holder(tmp_path_factory: pytest.TempPathFactory):
    with serving(tmp_path_factory.mktemp("durability"), SERVER_ENV) as h:
        yield h


@pytest.fixture
def client(holder: Holder):
    with make_client(holder.server) as c:
        yield c


@pytest.fixture(scope="module")
def big(essays: list[tuple[str, str]]) -> str:
    # ~15 chunks of 128 tokens: a build that outlasts ingest_wait_timeout_s many times over, and that is
    # still running when a test acts on it after its first chunks (each test waits for 2 or 4)
    return "\n\n".join(t for _, t in essays[:4])[:7_000]


def _ingest(client: httpx.Client, doc_id: str, text: str, **extra: object) -> dict:
    resp = client.post("/v1/documents", json={"id": doc_id, "text": text, "metadata": {"name": doc_id}, **extra})
    assert resp.status_code == 202, resp.text
    job = wait_job(client, resp.json()["job_id"])
    assert job["status"] == "ready", job
    return job


def _answers(client: httpx.Client, doc_id: str) -> dict:
    """The document answers a query (retrieved by its metadata: a long one does not fit the context whole)."""
    resp = client.post("/v1/query", json={"query": "What is this about?", "filters": {"name": doc_id}, "top_k": 2,
                                          "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    assert {s["document_id"] for s in resp.json()["sources"]} == {doc_id}
    return resp.json()


def test_health_details_need_a_key_and_stop_strings_are_limited(client: httpx.Client, holder: Holder) -> None:
    with make_client(holder.server, key=None) as anon:
        open_health = anon.get("/health").json()
        assert open_health["status"] == "ok" and "worker" not in open_health
    assert client.get("/health").json()["worker"]["pid"] > 0
    resp = client.post("/v1/query", json={"query": "q", "stop": ["a", "b", "c", "d", "e"]})
    assert resp.status_code == 422 and resp.json()["error"]["param"] == "stop", resp.text
    assert "at most 4" in resp.json()["error"]["message"]


def test_wait_timeout_names_the_job_its_status_and_where_to_look(client: httpx.Client, big: str) -> None:
    resp = client.post("/v1/documents?wait=true", json={"id": "slow", "text": big})
    assert resp.status_code == 202, resp.text
    body = resp.json()
    assert body["status"] in ("pending", "processing") and body["status_url"].endswith(f"/v1/jobs/{body['job_id']}")
    assert body["job_id"] in body["detail"] and body["status"] in body["detail"] and "ingest_wait_timeout_s" in body["detail"]
    assert client.get(body["status_url"]).status_code == 200
    assert wait_job(client, body["job_id"])["status"] == "ready"
    assert client.delete("/v1/documents/slow").status_code == 200


def test_a_failed_overwrite_keeps_the_good_version(client: httpx.Client, holder: Holder, big: str,
                                                   essays3: dict[str, str]) -> None:
    v1 = essays3["pow"]
    _ingest(client, "doc", v1)
    before = client.get("/v1/documents/doc").json()
    job = client.post("/v1/documents", json={"id": "doc", "text": big, "metadata": {"name": "doc"},
                                             "on_conflict": "overwrite"}).json()
    wait_progress(client, job["job_id"], 4)
    during = client.get("/v1/documents/doc").json()  # the old version answers while the new one is built
    assert during["status"] == "ready" and during["content_hash"] == sha(v1) and during["job"]["job_id"] == job["job_id"]
    _answers(client, "doc")
    os.kill(client.get("/health").json()["worker"]["pid"], signal.SIGKILL)  # mid-build
    failed = wait_job(client, job["job_id"])
    assert failed["status"] == "failed" and "worker crashed" in failed["error"], failed
    after = client.get("/v1/documents/doc").json()
    assert after["status"] == "ready" and after["content_hash"] == sha(v1) and after["chunks"] == before["chunks"]
    holder.server.wait_ready()  # the worker restarts
    _answers(client, "doc")


def test_a_delete_during_an_overwrite_wins(client: httpx.Client, big: str) -> None:
    job = client.post("/v1/documents", json={"id": "doc", "text": big, "on_conflict": "overwrite"}).json()
    wait_progress(client, job["job_id"], 2)
    assert client.delete("/v1/documents/doc").json() == {"id": "doc", "deleted": True}
    assert client.get(f"/v1/jobs/{job['job_id']}").json()["status"] == "cancelled"
    assert client.get("/v1/documents/doc").status_code == 404


def test_queued_ingests_survive_a_restart(holder: Holder, big: str, essays3: dict[str, str]) -> None:
    texts = {"q0": big, "q1": essays3["todo"], "q2": essays3["nft"]}
    with make_client(holder.server) as c:
        jobs = {}
        for doc_id, text in texts.items():
            resp = c.post("/v1/documents", json={"id": doc_id, "text": text, "metadata": {"name": doc_id}})
            assert resp.status_code == 202, resp.text
            jobs[doc_id] = resp.json()["job_id"]
        wait_progress(c, jobs["q0"], 2)  # the first is processing, the others queued
    holder.server.stop()
    holder.server.start()
    with make_client(holder.server) as c:
        for doc_id, job_id in jobs.items():
            job = wait_job(c, job_id)  # the job id still answers, and the job finishes
            assert job["status"] == "ready", job
            doc = c.get(f"/v1/documents/{doc_id}").json()
            assert doc["status"] == "ready" and doc["content_hash"] == sha(texts[doc_id])
            _answers(c, doc_id)


def test_a_model_change_never_reuses_the_old_models_kv(holder: Holder, tmp_path) -> None:
    """The server restarts on another model of the same shape (retuned weights): every document is
    rebuilt from its stored text, and no answer ever uses the old model's KV."""
    holder.server.stop()
    assert store_check(holder.server.data_dir)["problems"] == 0
    old = ServerProcess(holder.server.data_dir, holder.server.log_path, **SERVER_ENV)
    model = retuned_default_model(tmp_path / "retuned")
    holder.server = ServerProcess(holder.server.data_dir, holder.server.log_path,
                                  **SERVER_ENV, KVFUSE_MODEL__LLM=str(model)).start()
    with make_client(holder.server) as c:
        docs = c.get("/v1/documents").json()["documents"]
        assert docs and all(d["status"] == "ready" for d in docs)
        for d in docs:
            _answers(c, d["id"])  # answered, from KV rebuilt for this model
        deadline = time.monotonic() + 600
        while any(d.get("job") for d in c.get("/v1/documents").json()["documents"]):
            assert time.monotonic() < deadline
            time.sleep(0.5)
        stale_used = metric(c, "kvfuse_kv_fingerprint_misses_total") + metric(c, "kvfuse_rebuilt_chunks_total")
        rekeyed = metric(c, "kvfuse_precomputed_chunks_total")
        assert rekeyed > 0, "the documents were not rebuilt for the new model"
        assert stale_used > 0 or rekeyed >= sum(d["chunks"] for d in docs)
    holder.server.stop()
    rep = store_check(holder.server.data_dir)  # every blob is now the retuned model's
    assert rep["problems"] == 0 and rep["foreign"] == [] and rep["young_orphans"] == [], rep
    holder.server = old  # stopped; the fixture's stop() is a no-op
