"""A server with no API key (loopback) and a short request timeout: open access, 504 on slow queries, and
the timed-out generation is cancelled in the worker."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from service_helpers import ServerProcess, ingest, make_client, metric, sse_events

pytestmark = pytest.mark.slow

TIMEOUT_S = 4
LONG = {"query": "Describe everything in the documents in full detail, at great length, one point at a time.",
        "system_prompt": "You write very long, detailed answers that go on for many paragraphs.",
        "document_ids": ["owls"], "max_tokens": 2000}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("limits")
    srv = ServerProcess(root / "data", root / "server.log", KVFUSE_SERVER__API_KEYS="",
                        KVFUSE_SERVER__REQUEST_TIMEOUT_S=str(TIMEOUT_S)).start()
    try:
        with make_client(srv, key=None) as c:
            ingest(c, [{"id": "owls", "text": "Barn owls hunt at night. They swallow mice whole and cough up "
                                              "pellets of fur and bone."}])
        yield srv
    finally:
        srv.stop()


def _idle(c: httpx.Client, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while metric(c, "kvfuse_num_requests_running") or metric(c, "kvfuse_num_requests_waiting"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_no_key_configured_on_loopback_means_open_access(server: ServerProcess) -> None:
    with make_client(server, key=None) as c:
        assert c.get("/v1/documents").status_code == 200


def test_a_query_past_the_timeout_gets_504_and_its_generation_stops(server: ServerProcess) -> None:
    with make_client(server, key=None) as c:
        t0 = time.monotonic()
        resp = c.post("/v1/query", json=LONG)
        assert resp.status_code == 504, resp.text
        assert resp.json()["error"]["code"] == "timeout"
        assert time.monotonic() - t0 < TIMEOUT_S + 5
        assert _idle(c, 60), "the timed-out generation kept running"


def test_a_stream_past_the_timeout_ends_with_an_error_event(server: ServerProcess) -> None:
    with make_client(server, key=None) as c, c.stream("POST", "/v1/query", json={**LONG, "stream": True}) as resp:
        if resp.status_code == 504:  # timed out before the answer started
            resp.read()
            assert resp.json()["error"]["code"] == "timeout"
        else:
            events = list(sse_events(resp))
            assert events[-1] == (None, "[DONE]") and events[-2][0] == "error"
            err = json.loads(events[-2][1])
            assert err["status"] == 504 and err["error"]["code"] == "timeout"
    with make_client(server, key=None) as c:
        assert _idle(c, 60)
