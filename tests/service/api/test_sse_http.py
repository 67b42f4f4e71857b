"""Streams through sse-starlette over real HTTP: a client that leaves mid-stream cancels its generation
(the library stops the generator; the query's cleanup cancels the job), on /v1/query and on the OpenAI
stream alike, and the framing stays one `event:`/`data:` block per event ending with `data: [DONE]`."""

from __future__ import annotations

import time

import httpx
import pytest
from service_helpers import API_KEY, Holder, make_client, metric, serving, sse_events

pytestmark = pytest.mark.slow

SERVER_ENV = {"KVFUSE_SERVER__API_KEYS": API_KEY, "KVFUSE_STORE__PRECOMPUTE_CONTEXT": "none"}
LONG_SYSTEM = "You write very long, detailed answers that go on for many paragraphs."
LONG_QUESTION = "Describe everything in the document in full detail, at great length, one point at a time."
NOTE = ("The lighthouse keeper of Port Ellery logged the weather every morning and every evening for forty "
        "years, and the fishermen read his log before they went out.")


@pytest.fixture(scope="module")
def holder(tmp_path_factory: pytest.TempPathFactory):
    with serving(tmp_path_factory.mktemp("sse"), SERVER_ENV, {"note": NOTE}) as h:
        yield h


@pytest.fixture
def client(holder: Holder):
    with make_client(holder.server) as c:
        yield c


def _wait_metric(client: httpx.Client, name: str, value: float, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while (v := metric(client, name)) != value and time.monotonic() < deadline:
        time.sleep(0.1)
    return v


@pytest.mark.parametrize("path", ["/v1/query", "/v1/chat/completions"])
def test_leaving_mid_stream_cancels_the_generation(client: httpx.Client, path: str) -> None:
    cancelled = 'kvfuse_requests_total{outcome="cancelled"}'
    before = metric(client, cancelled)
    if path == "/v1/query":
        body = {"query": LONG_QUESTION, "system_prompt": LONG_SYSTEM, "document_ids": ["note"], "max_tokens": 400}
    else:
        body = {"model": "kvfuse", "document_ids": ["note"], "max_tokens": 400,
                "messages": [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": LONG_QUESTION}]}
    with client.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        for n, (_, data) in enumerate(sse_events(resp)):
            if n >= 2 and data != "[DONE]":
                break  # text is streaming: leave
    assert _wait_metric(client, "kvfuse_num_requests_running", 0, timeout=15) == 0
    assert _wait_metric(client, cancelled, before + 1, 5) == before + 1


def test_a_finished_stream_ends_with_done_and_every_event_is_one_json_line(client: httpx.Client) -> None:
    import json

    body = {"query": "What did the lighthouse keeper log?", "max_tokens": 3, "stream": True}
    with client.stream("POST", "/v1/query", json=body) as resp:
        events = list(sse_events(resp))
    assert [e for e, _ in events][:1] == ["sources"] and events[-1] == (None, "[DONE]")
    assert [e for e, _ in events][-2] == "done"
    for _, data in events[:-1]:
        json.loads(data)
