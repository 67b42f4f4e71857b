"""A fleet: an API with no model (`kvfuse serve --workers 0`) and `kvfuse worker` processes, each with its
own data dir, joined only by Redis. Ingestion and queries go through the job streams; both workers serve;
each answer names its worker; a worker killed mid-stream, an API restart and a flushed shared tier end
cleanly and the fleet goes on."""

from __future__ import annotations

import threading

import pytest
import redis
from fleet_helpers import WorkerProcess, fleet_env, query, start_api, wait_workers
from service_helpers import ingest, make_client

pytestmark = pytest.mark.slow

SMALL = {"KVFUSE_RETRIEVER__CHUNK_TOKENS": "128", "KVFUSE_RETRIEVER__TOP_K": "2",
         "KVFUSE_MODEL__MAX_CONTEXT_TOKENS": "2048", "KVFUSE_SERVER__MAX_RUNNING_REQUESTS": "2",
         "KVFUSE_SERVER__QUEUE_SIZE": "16"}
QUESTIONS = ["What did Bronnie Ware make a list of?", "What is an NFT?", "How does the author define power?",
             "Why do people regret things?", "What makes a good essay?", "What is a token?"]


@pytest.fixture
def fleet(tmp_path, redis_url, redis_namespace, essays3):
    """Workers a and b, then the API; essays3 ingested through the fleet."""
    env = {**fleet_env(redis_url, redis_namespace), **SMALL}
    workers = {n: WorkerProcess(n, tmp_path, **env).start() for n in ("a", "b")}
    api = None
    try:
        api = start_api(tmp_path, env)
        wait_workers(api.url, {"a", "b"}, workers=list(workers.values()))
        with make_client(api) as c:
            ingest(c, [{"id": name, "text": text} for name, text in essays3.items()])
        yield api, workers, env
    finally:
        if api is not None:
            api.stop()
        for w in workers.values():
            w.stop()


def run_concurrently(client, bodies: list[dict]) -> list[tuple[str, list]]:
    out: list = [None] * len(bodies)

    def one(i: int) -> None:
        out[i] = query(client, bodies[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return out


def test_two_workers_both_serve_and_answers_name_their_worker(fleet) -> None:
    api, workers, _ = fleet
    with make_client(api) as c:
        results = run_concurrently(c, [{"query": q, "max_tokens": 12} for q in QUESTIONS])
        served = []
        for text, events in results:
            assert events[-1] == ("done", "[DONE]") or events[-1][1] == "[DONE]"
            final = next(d for e, d in events if e == "done")
            assert text and final["answer"] == text and final["worker"] in ("a", "b")
            served.append(final["worker"])
        assert set(served) == {"a", "b"}, served
        body = c.post("/v1/query", json={"query": QUESTIONS[0], "max_tokens": 8}).json()
        assert body["worker"] in ("a", "b") and body["answer"]
        metrics = c.get("/metrics").text
        assert "kvfuse_live_workers 2.0" in metrics
    pending = redis.Redis.from_url(fleet[2]["KVFUSE_REDIS_URL"]).xpending(
        f"{fleet[2]['KVFUSE_FLEET__NAMESPACE']}:jobs", "workers")
    assert pending["pending"] == 0
