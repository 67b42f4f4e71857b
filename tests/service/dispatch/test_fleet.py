"""A fleet: an API with no model (`kvfuse serve --workers 0`) and `kvfuse worker` processes, each with its
own data dir, joined only by Redis. Ingestion and queries go through the job streams; both workers serve;
each answer names its worker; a worker killed mid-stream, an API restart and a flushed shared tier end
cleanly and the fleet goes on."""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
import redis
from fleet_helpers import WorkerProcess, fleet_env, live_workers, query, start_api, wait_workers
from service_helpers import ingest, make_client, sse_events

pytestmark = pytest.mark.slow

SMALL = {"KVFUSE_RETRIEVER__CHUNK_TOKENS": "128", "KVFUSE_RETRIEVER__TOP_K": "2",
         "KVFUSE_MODEL__MAX_CONTEXT_TOKENS": "2048", "KVFUSE_SERVER__MAX_RUNNING_REQUESTS": "2",
         "KVFUSE_SERVER__QUEUE_SIZE": "16"}
QUESTIONS = ["What did Bronnie Ware make a list of?", "What is an NFT?", "How does the author define power?",
             "Why do people regret things?", "What makes a good essay?", "What is a token?"]


@pytest.fixture(scope="module")
def fleet_namespace(_session_redis: str) -> Iterator[str]:
    """A namespace for the module's fleet; every key under it is deleted after the module."""
    ns = f"kvfuse-test-{uuid.uuid4().hex[:12]}"
    yield ns
    client = redis.Redis.from_url(_session_redis)
    for key in client.scan_iter(match=f"{ns}:*", count=1000):
        client.delete(key)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, _session_redis, fleet_namespace, essays3):
    """Workers a and b, then the API; essays3 ingested through the fleet. One fleet for the module's tests
    that take it: each leaves both workers and the API serving (a killed worker rejoins, a killed API is
    started again) and no job pending."""
    tmp_path = tmp_path_factory.mktemp("fleet")
    env = {**fleet_env(_session_redis, fleet_namespace), **SMALL}
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
        # each worker's device KV ledger, from its heartbeat, on /ready and in the metrics
        for name, w in live_workers(api.url).items():
            ledger = w["kv_ledger"]
            assert ledger["used_bytes"] <= ledger["peak_bytes"] <= ledger["budget_bytes"] and "query" in ledger["holders"]
            assert f'kvfuse_kv_ledger_budget_bytes{{device="cpu",worker="{name}"}}' in metrics
    pending = redis.Redis.from_url(fleet[2]["KVFUSE_REDIS_URL"]).xpending(
        f"{fleet[2]['KVFUSE_FLEET__NAMESPACE']}:jobs", "workers")
    assert pending["pending"] == 0


def _xpending(env: dict, stream: str) -> int:
    r = redis.Redis.from_url(env["KVFUSE_REDIS_URL"])
    if not r.exists(stream):
        return 0
    return r.xpending(stream, "workers")["pending"]


def _all_pending(env: dict) -> int:
    ns = env["KVFUSE_FLEET__NAMESPACE"]
    r = redis.Redis.from_url(env["KVFUSE_REDIS_URL"], decode_responses=True)
    streams = [f"{ns}:jobs", *(f"{ns}:jobs:{w}" for w in r.smembers(f"{ns}:workers"))]
    return sum(_xpending(env, s) for s in streams)


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


LONG = {"query": "Describe everything in the documents in full detail, at great length.", "max_tokens": 400,
        "document_ids": ["pow"]}


def test_a_worker_killed_mid_stream_ends_its_request_cleanly_and_rejoins(fleet) -> None:
    api, workers, env = fleet
    with make_client(api) as c:
        with c.stream("POST", "/v1/query", json={**LONG, "stream": True}) as resp:
            assert resp.status_code == 200
            events, victim = [], None
            for event, data in sse_events(resp):
                events.append((event, data))
                if event == "token" and victim is None:
                    _wait_for(lambda: any(w["running"] for w in live_workers(api.url).values()), 30, "a running job")
                    victim = next(n for n, w in live_workers(api.url).items() if w["running"])
                    workers[victim].kill()
        # The request had streamed tokens: it ends with an error event, then [DONE]; or it was re-run whole.
        assert events[-1] == (None, "[DONE]")
        last = events[-2]
        if last[0] == "error":
            err = json.loads(last[1])["error"]
            assert err["code"] == "worker_crashed" and victim in err["message"]
            assert "restarted" not in err["message"]  # nothing restarts a fleet worker
        else:
            assert last[0] == "done" and json.loads(last[1])["worker"] != victim
        survivor = ({"a", "b"} - {victim}).pop()
        wait_workers(api.url, {survivor}, timeout=30)
        for q in QUESTIONS[:2]:
            body = c.post("/v1/query", json={"query": q, "max_tokens": 8}).json()
            assert body["worker"] == survivor and body["answer"]
        workers[victim].start()  # restarted: rejoins under its name
        wait_workers(api.url, {"a", "b"}, workers=list(workers.values()))
        _wait_for(lambda: _all_pending(env) == 0, 30, "no pending job")


def test_api_restarted_while_workers_run(fleet) -> None:
    api, workers, env = fleet
    failed = []

    def long_query() -> None:
        try:
            with make_client(api) as c:
                text, events = query(c, LONG)
                failed.append(events[-2][0] != "done" if len(events) > 1 else True)
        except (httpx.TransportError, AssertionError):
            failed.append(True)

    t = threading.Thread(target=long_query)
    t.start()
    _wait_for(lambda: any(w["running"] for w in live_workers(api.url).values()), 120, "a running job")
    api.proc.send_signal(signal.SIGKILL)  # the harshest restart: no chance to tell the workers
    api.proc.wait(30)
    t.join(60)
    assert failed == [True]  # the in-flight request failed (its connection went)
    api.start()  # the same data dir; workers kept running
    with make_client(api) as c:
        body = c.post("/v1/query", json={"query": QUESTIONS[1], "max_tokens": 8}).json()
        assert body["answer"] and body["worker"] in ("a", "b")
    # The orphaned job is dropped once its reply stream expires: nothing stays pending.
    _wait_for(lambda: _all_pending(env) == 0 and not any(w["running"] for w in live_workers(api.url).values()),
              60, "no pending job")


def test_chunks_computed_on_one_worker_are_served_on_another_from_the_shared_tier(
        tmp_path, redis_url, redis_namespace, essays3) -> None:
    env = {**fleet_env(redis_url, redis_namespace), **SMALL}
    a = WorkerProcess("a", tmp_path, **env).start()
    b = WorkerProcess("b", tmp_path, **env)
    api = None
    try:
        api = start_api(tmp_path, env)
        with make_client(api) as c:
            ingest(c, [{"id": name, "text": text} for name, text in essays3.items()])  # all computed on a
            b.start()
            wait_workers(api.url, {"a", "b"}, workers=[a, b])
            # Locality: a holds every chunk and has room, so a query on them goes to a.
            body = c.post("/v1/query", json={"query": QUESTIONS[2], "max_tokens": 4, "document_ids": ["todo"]}).json()
            assert body["worker"] == "a"
            a.stop()
            wait_workers(api.url, {"b"}, timeout=30)
            body = c.post("/v1/query", json={"query": QUESTIONS[2], "max_tokens": 8, "document_ids": ["pow"]}).json()
            assert body["worker"] == "b" and body["answer"]
            # b's counters reach /ready with its next heartbeat (every fleet.heartbeat_s)
            _wait_for(lambda: live_workers(api.url)["b"]["kv"]["hits_shared"] >= 1, 10, "the shared hit counted")
            kv = live_workers(api.url)["b"]["kv"]
            assert kv["hits_shared"] >= 1 and kv["rebuilt"] == 0 and kv["hits_miss"] == 0, kv
            # The shared tier flushed: b rebuilds the chunks it never held from their token ids.
            r = redis.Redis.from_url(redis_url)
            keys = list(r.scan_iter(match=f"{env['KVFUSE_FLEET__NAMESPACE']}:kv:*"))
            assert keys
            r.delete(*keys)
            body = c.post("/v1/query", json={"query": QUESTIONS[1], "max_tokens": 8, "document_ids": ["nft"],
                                             "fusion": {"cold_chunks": "compute"}}).json()  # read, missed, rebuilt
            assert body["worker"] == "b" and body["answer"]
            _wait_for(lambda: live_workers(api.url)["b"]["kv"]["rebuilt"] >= 1, 10, "the rebuild counted")
            assert live_workers(api.url)["b"]["kv"]["hits_miss"] >= 1
    finally:
        if api is not None:
            api.stop()
        a.stop()
        b.stop()


def test_a_worker_with_another_model_is_refused(tmp_path, redis_url, redis_namespace) -> None:
    env = fleet_env(redis_url, redis_namespace)
    redis.Redis.from_url(redis_url).set(f"{env['KVFUSE_FLEET__NAMESPACE']}:fingerprint", "another-model", px=600_000)
    w = WorkerProcess("odd", tmp_path, **env).start()
    assert w.proc.wait(300) == 3
    assert "refused" in w.log_tail() and "another-model" in w.log_tail()


def test_a_job_a_dead_worker_took_before_any_token_runs_again_on_a_survivor(tmp_path, redis_url,
                                                                           redis_namespace) -> None:
    from kvfuse.service.wire import protocol as P
    from kvfuse.service.wire.codec import decode, encode

    env = fleet_env(redis_url, redis_namespace)
    ns = env["KVFUSE_FLEET__NAMESPACE"]
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    reply = f"{ns}:reply:left-behind"
    r.xadd(reply, {"t": "Open"})
    r.expire(reply, 600)
    r.xgroup_create(f"{ns}:jobs", "workers", id="0", mkstream=True)
    r.xadd(f"{ns}:jobs", encode(P.PrecomputeJob([[1, 2, 3, 4, 5]], 1), uid="left-behind"))
    # A fake of a worker that died right after taking the job: it read the entry, then vanished (no
    # heartbeat, no XACK). A real SIGKILL cannot be timed to land between the read and the first reply.
    assert r.xreadgroup("workers", "ghost", {f"{ns}:jobs": ">"}, count=1)
    r.xadd(reply, {"t": "Taken", "w": "ghost"})
    w = WorkerProcess("survivor", tmp_path, **env).start()
    try:
        def done() -> list:
            return [decode(f) for _, f in r.xrange(reply) if f.get("t") == "Done"]

        _wait_for(lambda: bool(done()) or w.proc.poll() is not None, 300, "the job to run again")
        (msg,) = done()
        assert msg.worker == "survivor" and msg.computed == 1 and msg.job_id == 1
        assert [f.get("w") for _, f in r.xrange(reply) if f.get("t") == "Taken"] == ["ghost", "survivor"]
        _wait_for(lambda: _all_pending(env) == 0, 30, "no pending job")
    finally:
        w.stop()


def test_with_no_live_worker_a_query_is_refused_at_once_and_one_in_flight_ends(tmp_path, redis_url, redis_namespace,
                                                                             essays) -> None:
    """Nothing restarts a fleet worker: once the heartbeats (what /ready reads) show none, a query in flight
    ends with an error event and a new one is answered 503 with Retry-After, neither after a long wait."""
    # A prefill in many short engine steps: the plan goes out at the first, the first token after the last
    # (chunks cached alone: a quick ingestion).
    env = {**fleet_env(redis_url, redis_namespace), **SMALL, "KVFUSE_SERVER__PREFILL_TOKENS_PER_STEP": "32",
           "KVFUSE_STORE__PRECOMPUTE_CONTEXT": "none"}
    ttl = float(env["KVFUSE_FLEET__HEARTBEAT_TTL_S"])
    a = WorkerProcess("a", tmp_path, **env).start()
    api = None
    try:
        api = start_api(tmp_path, env)
        wait_workers(api.url, {"a"}, workers=[a])
        name, text = max(essays, key=lambda e: len(e[1]))
        with make_client(api) as c:
            ingest(c, [{"id": "long", "text": text[:5000]}])  # a prefill long enough to kill the worker in it
            body = {"query": "Summarise the document.", "document_ids": ["long"], "max_tokens": 300,
                    "fusion": {"method": "vanilla"}, "stream": True}
            with c.stream("POST", "/v1/query", json=body) as resp:
                assert resp.status_code == 200
                events, killed = [], None
                for event, data in sse_events(resp):
                    events.append((event, data))
                    if event == "sources":  # the worker has admitted the query and is in its prefill
                        a.kill()
                        killed = time.monotonic()
            ended = time.monotonic() - killed
            assert [e for e, _ in events] == ["sources", "error", None], events  # no token went out
            err = json.loads(events[1][1])
            assert err["status"] == 503 and err["error"]["code"] == "no_live_worker", err
            assert "the worker a serving this request died: no live worker in the fleet" in err["error"]["message"]
            assert ended < ttl + 5, ended  # the heartbeat's TTL and a poll, not a timeout of its own
            assert live_workers(api.url) == {}

            t0 = time.monotonic()
            resp = c.post("/v1/query", json={**body, "stream": False})
            assert time.monotonic() - t0 < 5
            assert resp.status_code == 503 and int(resp.headers["Retry-After"]) >= 1, resp.text
            err = resp.json()["error"]
            assert err["code"] == "no_live_worker" and "no live worker in the fleet" in err["message"], err
            assert "restarted" not in err["message"]
            with c.stream("POST", "/v1/query", json=body) as streamed:  # refused before any event
                assert streamed.status_code == 503 and "Retry-After" in streamed.headers
            # the query in flight and the two refused
            assert 'kvfuse_requests_total{outcome="no_live_worker"} 3.0' in c.get("/metrics").text
    finally:
        if api is not None:
            api.stop()
        a.stop()


def test_concurrent_queries_on_chunks_one_worker_holds_spill_to_an_idle_worker(tmp_path, redis_url, redis_namespace,
                                                                             essays3) -> None:
    """Every chunk computed on a, then b joins: six queries at once over them run on both (locality is
    weighed against load; b reads the chunks from the shared tier), not all six on a while b idles."""
    env = {**fleet_env(redis_url, redis_namespace), **SMALL, "KVFUSE_SERVER__MAX_RUNNING_REQUESTS": "16"}
    a = WorkerProcess("a", tmp_path, **env).start()
    b = WorkerProcess("b", tmp_path, **env)
    api = None
    try:
        api = start_api(tmp_path, env)
        wait_workers(api.url, {"a"}, workers=[a])
        with make_client(api) as c:
            ingest(c, [{"id": name, "text": text} for name, text in essays3.items()])
            b.start()
            wait_workers(api.url, {"a", "b"}, workers=[a, b])
            docs = list(essays3)
            results = run_concurrently(c, [{"query": q, "max_tokens": 24, "document_ids": docs} for q in QUESTIONS])
            served = [next(d for e, d in events if e == "done")["worker"] for _, events in results]
            assert sorted(set(served)) == ["a", "b"], served
            _wait_for(lambda: live_workers(api.url)["b"]["kv"]["hits_shared"] >= 1, 10, "b's shared reads counted")
            assert live_workers(api.url)["b"]["kv"]["rebuilt"] == 0
    finally:
        if api is not None:
            api.stop()
        a.stop()
        b.stop()
