"""The deployments users run, run for real: the committed Dockerfile built into kvfuse:cpu, and both compose
files (with their committed CPU overrides) brought up on a real Docker engine with no image registry
(conftest.py builds the images). `up --wait` must mean "answers queries"; then, over real HTTP:

- docker-compose.yml: ready at once, 401 without the key, a document ingested and a streamed answer from
  its stored KV; the document and its KV still there after `docker compose restart kvfuse` and after the
  Redis container restarts (its AOF reloaded, the LMDB volume kept).
- docker-compose.fleet.yml with two workers: both serve; one worker container killed mid-load, queries go
  on, every accepted ingestion finishes and every query in flight ends with an answer or a stated error.

Each phase's time is printed as it ends (Phases). Run it with `make test-deploy` (docs/deploy.md).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from compose_stack import Phases, Stack, streamed_answer
from deploy_images import compose_env
from redis_server import free_port

pytestmark = pytest.mark.deploy

DOCS = {
    "lisbon": "The special magic number for Lisbon is 4417206. Lisbon is the capital of Portugal, on the Tagus.",
    "oslo": "The special magic number for Oslo is 9021377. Oslo lies at the head of the Oslofjord in Norway.",
    "quito": "The special magic number for Quito is 5530118. Quito sits high in the Andes, in Ecuador.",
}
QUESTION = "What is the special magic number for Lisbon?"


def _ingest(client, doc_id: str, wait: bool = True):
    resp = client.post(f"/v1/documents?wait={'true' if wait else 'false'}",
                       json={"id": doc_id, "text": DOCS[doc_id], "metadata": {"source": "deploy-test"}})
    assert resp.status_code in ((200, 201) if wait else (202,)), resp.text
    return resp.json()


def _kv_answer(client, max_tokens: int = 16) -> dict:
    """A streamed answer that reused stored KV: its `done` event (tokens arrived, no chunk rebuilt)."""
    text, events = streamed_answer(client, QUESTION, max_tokens=max_tokens, document_ids=["lisbon"])
    assert text and [e for e, _ in events][-1] == "message" and events[-1][1] == "[DONE]", events
    done = next(d for e, d in events if e == "done")
    assert done["usage"]["cached_tokens"] > 0, done["usage"]  # the stored chunk KV, not a fresh prefill
    return done


def _rebuilt_chunks(client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("kvfuse_rebuilt_chunks_total "):
            return float(line.split()[1])
    return 0.0


def test_single_host_compose(engine, images, phases) -> None:
    stack = Stack(engine, "kvfuse-e2e", ["docker-compose.yml", "docker-compose.cpu.yml"], compose_env(engine),
                  free_port())
    stack.down()  # what an aborted run left
    try:
        with phases("single host: up --wait (redis, then kvfuse loading its model)"):
            stack.up()
        with phases("single host: 401, ingest, streamed answer"):
            assert stack.health("kvfuse") == "healthy"
            # the image checked its model when it was built: the container starts without checking
            assert "model check skipped" in stack.logs("kvfuse", 400), stack.logs("kvfuse", 400)
            with stack.client(key=None) as anon:
                assert anon.get("/ready").status_code == 200  # `up --wait` returned: it answers
                assert anon.get("/v1/models").status_code == 401
                assert anon.post("/v1/query", json={"query": QUESTION}).status_code == 401
            with stack.client() as c:
                assert _ingest(c, "lisbon")["status"] == "ready"
                _kv_answer(c)
        with phases("single host: docker compose restart kvfuse"):
            stack.compose("restart", "kvfuse")
            stack.up()
            with stack.client() as c:
                doc = c.get("/v1/documents/lisbon").json()
                assert doc["status"] == "ready" and doc["kv_bytes"] > 0, doc
                _kv_answer(c)
                assert _rebuilt_chunks(c) == 0  # read back from the LMDB volume
        with phases("single host: the Redis container restarts"):
            stack.compose("restart", "redis")
            stack.up()
            assert "DB loaded from append only file" in stack.logs("redis", 200)
            with stack.client() as c:
                until_ready(c)
                assert c.get("/v1/documents/lisbon").json()["status"] == "ready"
                _kv_answer(c)
                assert _rebuilt_chunks(c) == 0
    except BaseException:
        print(stack.diagnosis())
        raise
    finally:
        with phases("single host: down -v"):
            stack.down()


def until_ready(client, timeout: float = 120.0) -> None:
    """/ready 200 (kvfuse reconnects to a restarted Redis on its own, within its retry pause)."""
    deadline = time.monotonic() + timeout
    while client.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, client.get("/ready").text
        time.sleep(1)


def test_fleet_compose_with_two_workers(engine, images, phases) -> None:
    env = compose_env(engine, KVFUSE_REDIS_PUBLISH_PORT=str(free_port()))
    stack = Stack(engine, "kvfuse-fleet", ["docker-compose.fleet.yml", "docker-compose.fleet.cpu.yml"], env, free_port())
    stack.down()
    try:
        with phases("fleet: up --wait --scale worker=2"):
            stack.up("--scale", "worker=2")
        with stack.client() as c:
            with phases("fleet: both workers serve"):
                assert len(c.get("/ready").json()["workers"]) == 2
                start = time.monotonic()
                _ingest(c, "lisbon")
                Phases.say(f"ingested through the fleet in {time.monotonic() - start:.1f} s")
            with phases("fleet: the chunks' KV is in the object store"):
                _in_object_store(stack, c.get("/v1/documents/lisbon").json()["chunks"])
                served = _answers_by_worker(c)
                assert len(served) == 2, served
            with phases("fleet: a worker killed under load, nothing accepted lost"):
                _kill_a_worker_under_load(stack, c)
    except BaseException:
        print(stack.diagnosis())
        raise
    finally:
        with phases("fleet: down -v"):
            stack.down()


def _in_object_store(stack: Stack, chunks: int, timeout: float = 60.0) -> None:
    """The SeaweedFS service holds at least the document's chunks as objects under object_store.url's
    prefix (s3://kvfuse/kv), as its filer lists them (the upload may trail `ready` by a moment)."""
    listing = ("import json, urllib.request as u; print(len(json.load(u.urlopen(u.Request("
               "'http://127.0.0.1:8888/buckets/kvfuse/kv/?limit=10000', headers={'Accept': 'application/json'})))"
               ".get('Entries') or []))")
    deadline = time.monotonic() + timeout
    while True:
        out = stack.engine.docker("exec", stack.container("seaweedfs"), "python3", "-c", listing, check=False)
        last = out.stdout.strip().splitlines()[-1:] if out.returncode == 0 else []
        objects = int(last[0]) if last and last[0].isdigit() else 0
        if objects >= chunks:
            Phases.say(f"{objects} objects in the object store for {chunks} chunks")
            return
        assert time.monotonic() < deadline, (objects, chunks, out.stdout)
        time.sleep(2)


def _answers_by_worker(c, rounds: int = 4) -> set[str]:
    """Concurrent streamed queries until answers came from two workers (a worker holding the chunk keeps
    a query only while it has few jobs: fleet.route_load_weight)."""
    seen: set[str] = set()
    with ThreadPoolExecutor(4) as pool:
        for n in range(1, rounds + 1):
            start = time.monotonic()
            done = list(pool.map(lambda _: _kv_answer(c, max_tokens=8), range(4)))
            workers = [d["worker"] for d in done]
            ttft = sorted(round(d["timings"]["ttft_ms"] / 1000, 1) for d in done)
            Phases.say(f"round {n} of 4 concurrent queries answered by {sorted(workers)} in "
                       f"{time.monotonic() - start:.1f} s (first tokens after {ttft} s)")
            seen.update(workers)
            if len(seen) == 2:
                break
    return seen


def _kill_a_worker_under_load(stack: Stack, c) -> None:
    """Ingestion accepted (202) and queries streaming while worker 1 is killed: every job finishes ready,
    every query ends with an answer or a stated error (worker_crashed, no hang), and the next ones are
    answered by the survivor."""
    jobs = [_ingest(c, doc_id, wait=False)["job_id"] for doc_id in ("oslo", "quito")]
    outcomes: list[str] = []

    def ask() -> None:
        _, events = streamed_answer(c, QUESTION, max_tokens=32, document_ids=["lisbon"])
        assert events[-1][1] == "[DONE]", events
        names = [e for e, _ in events]
        if "done" in names:
            outcomes.append("answered")
        else:
            err = next(d for e, d in events if e == "error")["error"]
            assert err["code"] in ("worker_crashed", "no_live_worker"), err
            outcomes.append(err["code"])

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    stack.engine.docker("kill", stack.container("worker", 1))
    for t in threads:
        t.join(300)
    assert len(outcomes) == 3 and not any(t.is_alive() for t in threads), outcomes
    Phases.say(f"in-flight queries when a worker was killed: {sorted(outcomes)}")
    for job_id in jobs:
        deadline = time.monotonic() + 300
        while (job := c.get(f"/v1/jobs/{job_id}").json())["status"] in ("pending", "processing"):
            assert time.monotonic() < deadline, job
            time.sleep(1)
        assert job["status"] == "ready", job
    for doc_id in DOCS:
        assert c.get(f"/v1/documents/{doc_id}").json()["status"] == "ready"
    killed = {w["id"] for w in c.get("/ready").json()["workers"]}  # the survivor (and the killed one, if
    for _ in range(2):                                                # Docker restarted it meanwhile)
        assert _kv_answer(c)["worker"] in killed
