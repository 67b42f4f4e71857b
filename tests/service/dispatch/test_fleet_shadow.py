"""Shadow checks on a fleet: a `kvfuse worker` runs them in its idle time like a local worker, and their
verdicts reach the API's ledger through the fleet's shadow stream in Redis (a verdict outlives its job, so
it cannot travel on the job's reply stream)."""

from __future__ import annotations

import pytest
from fleet_helpers import WorkerProcess, fleet_env, start_api, wait_workers
from service_helpers import ingest, make_client, until

from kvfuse.answer_match import same_answer

pytestmark = pytest.mark.slow

QUESTIONS = ["What did Bronnie Ware make a list of?", "What is an NFT?", "How does the author define power?"]


def test_a_fleet_worker_checks_in_its_idle_time_and_the_api_counts_the_verdicts(tmp_path, redis_url,
                                                                                 redis_namespace, essays3) -> None:
    env = {**fleet_env(redis_url, redis_namespace), "KVFUSE_RETRIEVER__CHUNK_TOKENS": "128",
           "KVFUSE_RETRIEVER__TOP_K": "2", "KVFUSE_FIDELITY__SHADOW_RATE": "1.0", "KVFUSE_MODEL__THREADS": "1"}
    worker = WorkerProcess("a", tmp_path, **env).start()
    api = None
    try:
        api = start_api(tmp_path, env)
        wait_workers(api.url, {"a"}, workers=[worker])
        with make_client(api) as c:
            ingest(c, [{"id": name, "text": text} for name, text in essays3.items()])
            expected = 0
            for q in QUESTIONS:
                fused = c.post("/v1/query", json={"query": q, "max_tokens": 10, "fusion": {"method": "anchor"}})
                full = c.post("/v1/query", json={"query": q, "max_tokens": 10, "fusion": {"method": "vanilla"}})
                assert fused.status_code == full.status_code == 200, (fused.text, full.text)
                expected += same_answer(fused.json()["answer"], full.json()["answer"], "value")
            rep = until(lambda: (r := c.get("/v1/fidelity").json()["methods"].get("anchor", {})).get("shadowed")
                        == len(QUESTIONS) and r, 300, "the fleet worker's verdicts")
            assert (rep["compared"], rep["agreements"]) == (len(QUESTIONS), expected)
    finally:
        if api is not None:
            api.stop()
        worker.stop()
