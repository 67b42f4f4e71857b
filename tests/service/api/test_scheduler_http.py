"""Many users at once over real HTTP: a real server whose worker batches the running queries under a
small KV budget. Streams that share decode steps get the answers they get alone; a client that leaves
frees its place; a query that does not fit waits, a full queue answers 429, an impossible one 400."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from service_helpers import API_KEY, ServerProcess, ingest, make_client, metric, sse_events

pytestmark = pytest.mark.slow

KV_BUDGET = 1000
SERVER_ENV = {
    "KVFUSE_SERVER__API_KEYS": API_KEY,
    "KVFUSE_RETRIEVER__CHUNK_TOKENS": "128",
    "KVFUSE_RETRIEVER__TOP_K": "2",
    "KVFUSE_MODEL__MAX_CONTEXT_TOKENS": "2048",
    "KVFUSE_SERVER__QUEUE_SIZE": "4",
    "KVFUSE_SERVER__MAX_RUNNING_REQUESTS": "4",
    "KVFUSE_SERVER__KV_BUDGET_TOKENS": str(KV_BUDGET),
    "KVFUSE_SERVER__REQUEST_TIMEOUT_S": "300",
}
LONG_SYSTEM = "You write very long, detailed answers that go on for many paragraphs."
LONG_QUESTION = "Describe everything in the documents in full detail, at great length, one point at a time."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, essays3: dict[str, str]):
    root = tmp_path_factory.mktemp("sched-http")
    srv = ServerProcess(root / "data", root / "server.log", **SERVER_ENV).start()
    try:
        with make_client(srv) as c:
            ingest(c, [{"id": name, "text": text} for name, text in essays3.items()])
        yield srv
    finally:
        srv.stop()


def bodies() -> list[dict]:
    """Different contexts, questions, methods and lengths; one sampled with a seed."""
    return [{"query": "What did Bronnie Ware make a list of?", "max_tokens": 20},
            {"query": "What is an NFT?", "max_tokens": 16, "fusion": {"method": "vanilla"}},
            {"query": "How does the author define power?", "max_tokens": 40, "fusion": {"method": "a3"}},
            {"query": "Why do people regret things?", "max_tokens": 18, "temperature": 0.9, "seed": 4,
             "stop": ["\n\n"], "fusion": {"method": "pie"}}]


def stream(client: httpx.Client, body: dict, leave_after: int | None = None) -> dict:
    """A streamed query: its text and final event; leaves (disconnects) after `leave_after` tokens."""
    text, final, tokens = "", None, 0
    with client.stream("POST", "/v1/query", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        for event, data in sse_events(resp):
            if event == "token":
                text += json.loads(data)["text"]
                tokens += 1
                if leave_after is not None and tokens >= leave_after:
                    return {"left": True, "text": text}
            elif event == "done":
                final = json.loads(data)
    return {"text": text, "final": final}


def test_streams_share_steps_and_a_client_that_leaves_changes_no_other_answer(server: ServerProcess) -> None:
    with make_client(server) as c:
        alone = [stream(c, b) for b in bodies()]
        cancelled = metric(c, 'kvfuse_requests_total{outcome="cancelled"}')
    out: list[dict | None] = [None] * 4

    def user(i: int) -> None:
        with make_client(server, timeout=600) as c:
            out[i] = stream(c, bodies()[i], leave_after=2 if i == 2 else None)

    threads = [threading.Thread(target=user, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert out[2]["left"]
    for i in (0, 1, 3):
        assert out[i]["text"] == alone[i]["text"] == out[i]["final"]["answer"]
        assert out[i]["final"]["finish_reason"] == alone[i]["final"]["finish_reason"]
    with make_client(server) as c:
        deadline = time.monotonic() + 30
        while metric(c, 'kvfuse_requests_total{outcome="cancelled"}') < cancelled + 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert metric(c, 'kvfuse_requests_total{outcome="cancelled"}') == cancelled + 1
        assert metric(c, "kvfuse_num_requests_running") == 0
        # the streams shared decode steps: more sequences than steps
        assert metric(c, "kvfuse_decode_batch_size_sum") > metric(c, "kvfuse_decode_batch_size_count")
        assert metric(c, "kvfuse_generation_tokens_total") > 0 and metric(c, "kvfuse_prompt_tokens_total") > 0
        # the worker's KV memory: allocated once at the budget, and nothing held once every stream ended
        text = c.get("/metrics").text
        budget = [float(x.split()[-1]) for x in text.splitlines() if x.startswith("kvfuse_kv_budget_bytes{")]
        held = [float(x.split()[-1]) for x in text.splitlines() if x.startswith("kvfuse_kv_pool_bytes{")]
        assert len(budget) == 1 and budget[0] > 0 and held == [0.0], (budget, held)
        # the one device KV ledger by holder: the streams' extents held, all given back, within its budget
        ledger = {x.split("{")[1].split("}")[0]: float(x.split()[-1]) for x in text.splitlines()
                  if x.startswith("kvfuse_kv_ledger_bytes{")}
        (limit,) = [float(x.split()[-1]) for x in text.splitlines() if x.startswith("kvfuse_kv_ledger_budget_bytes{")]
        (peak,) = [float(x.split()[-1]) for x in text.splitlines() if x.startswith("kvfuse_kv_ledger_peak_bytes{")]
        query = [v for k, v in ledger.items() if 'holder="query"' in k]
        assert query == [0.0] and budget[0] <= limit and 0 < peak <= limit, (ledger, limit, peak)


def test_kv_budget_makes_queries_wait_a_full_queue_gets_429_and_none_is_lost(server: ServerProcess) -> None:
    long = {"query": LONG_QUESTION, "system_prompt": LONG_SYSTEM, "max_tokens": 100}  # ~450 KV tokens: 2 fit
    with make_client(server) as c:
        too_big = c.post("/v1/query", json={"query": "What is an NFT?", "max_tokens": 1500})
        assert too_big.status_code == 400 and too_big.json()["error"]["code"] == "kv_budget_exceeded"
        assert "kv_budget_tokens" in too_big.json()["error"]["message"]
    results: list[dict | None] = [None] * 6

    def user(i: int) -> None:
        with make_client(server, timeout=600) as c:
            resp = c.post("/v1/query", json=long)
            results[i] = {"status": resp.status_code, "body": resp.json()}

    threads = [threading.Thread(target=user, args=(i,)) for i in range(6)]
    with make_client(server) as c:
        for t in threads[:2]:
            t.start()
        _wait(c, "kvfuse_num_requests_running", 2)
        for t in threads[2:]:
            t.start()
        _wait(c, "kvfuse_num_requests_waiting", 4)  # over the KV budget: they wait, no 429 yet
        assert metric(c, "kvfuse_num_requests_running") == 2
        full = c.post("/v1/query", json={"query": "What is an NFT?", "max_tokens": 4})
        assert full.status_code == 429 and full.headers.get("retry-after") is not None
        assert full.json()["error"]["code"] == "queue_full"
    for t in threads:
        t.join(600)
    assert [r["status"] for r in results] == [200] * 6, results  # every waiting query completed
    assert all(r["body"]["answer"] for r in results)
    assert max(r["body"]["timings"]["queue_ms"] for r in results) > 0


def _wait(client: httpx.Client, name: str, value: float, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while metric(client, name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.05)
