"""The service over real HTTP: a real server process, real worker, real default model, real LMDB and
FAISS. One server for the module (configured with an API key, a short context and small chunks so
prompts stay small); the tests run in file order and the last one restarts it on the same data dir."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest
from service_helpers import (
    API_KEY,
    REPO,
    Holder,
    ServerProcess,
    ingest,
    make_client,
    metric,
    read_stream,
    serving,
)

from kvfuse.service.api.responses import DocumentOut, DocumentPage, QueryAnswer, QuerySources

pytestmark = pytest.mark.slow

MAX_CONTEXT = 1024
SECOND_KEY = "second-key-9876543210"
SERVER_ENV = {
    # As a JSON list, as deployment tools write a list (a comma-separated list works too, see test_config.py).
    "KVFUSE_SERVER__API_KEYS": json.dumps([API_KEY, SECOND_KEY]),
    "KVFUSE_RETRIEVER__CHUNK_TOKENS": "128",
    "KVFUSE_RETRIEVER__TOP_K": "2",
    "KVFUSE_FUSION__SAMKV_INGEST_ARTIFACTS": "true",  # the ingest-time path of samkv's artifacts
    "KVFUSE_MODEL__MAX_CONTEXT_TOKENS": str(MAX_CONTEXT),
    "KVFUSE_GENERATION__MAX_TOKENS": "8",
    "KVFUSE_SERVER__QUEUE_SIZE": "4",
    "KVFUSE_SERVER__MAX_BODY_BYTES": "200000",
    "KVFUSE_SERVER__MAX_DOCUMENT_CHARS": "100000",
    "KVFUSE_SERVER__MAX_BATCH_DOCUMENTS": "8",
    "KVFUSE_SERVER__REQUEST_TIMEOUT_S": "240",
    # One try: a worker crash fails the ingestion at once (its retries: test_ingest_retry.py).
    "KVFUSE_SERVER__INGEST_RETRY_ATTEMPTS": "1",
}
QUESTION = "What did the palliative care nurse Bronnie Ware make a list of?"  # answered by "todo"
# Prompts that make the model talk for a long time, so a test can act while it generates.
LONG_SYSTEM = "You write very long, detailed answers that go on for many paragraphs."
LONG_QUESTION = "Describe everything in the documents in full detail, at great length, one point at a time."


@pytest.fixture(scope="module")
def holder(tmp_path_factory: pytest.TempPathFactory, essays3: dict[str, str]):
    with serving(tmp_path_factory.mktemp("service"), SERVER_ENV, essays3) as h:
        yield h


@pytest.fixture
def client(holder: Holder):
    with make_client(holder.server) as c:
        yield c


def snapshot(client: httpx.Client) -> list[tuple]:
    docs = client.get("/v1/documents", params={"limit": 1000}).json()["documents"]
    return sorted((d["id"], d["status"], d["chunks"], d["tokens"], d["kv_bytes"], d["updated_at"]) for d in docs)


# -- health, readiness, auth ------------------------------------------------------------------------------

def test_health_and_ready_are_open_without_a_key(holder: Holder) -> None:
    """Probes need no key, but the worker's details (pid, errors naming hosts) are for a valid key only."""
    with make_client(holder.server) as keyed:
        health = keyed.get("/health")
        assert health.status_code == 200 and health.json()["worker"]["ready"] is True
        assert isinstance(health.json()["worker"]["pid"], int)
        workers = keyed.get("/ready").json()["workers"]
        assert [w["pid"] for w in workers] == [health.json()["worker"]["pid"]]
        assert workers[0]["prompt"]["style"] == "chat"  # the default model has a chat template with a system turn
        # the worker's one device KV ledger: its budget and what each holder holds (engine/ledger.py)
        ledger = workers[0]["kv_ledger"]
        assert ledger["device"] == "cpu" and ledger["budget_bytes"] > 0
        assert set(ledger["holders"]) >= {"query", "shadow", "ingest", "prefix"}
        assert sum(ledger["holders"].values()) == ledger["used_bytes"] <= ledger["peak_bytes"] <= ledger["budget_bytes"]
    with make_client(holder.server, key=None) as anon:
        health = anon.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert health.json().get("worker") is None
        ready = anon.get("/ready")
        assert ready.status_code == 200 and ready.json()["workers"] == []
        assert ready.json()["components"] == {"store": True, "index": True, "embedder": True, "model": True,
                                              "document_index": True}


def test_api_key_is_required_and_both_headers_work(holder: Holder) -> None:
    with make_client(holder.server, key=None) as anon:
        missing = anon.get("/v1/documents")
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "missing_api_key"
        assert missing.headers["www-authenticate"] == "Bearer"
        wrong = anon.get("/v1/documents", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert anon.get("/v1/documents", headers={"X-API-Key": "nope"}).status_code == 401
        assert anon.get("/metrics").status_code == 401
        assert anon.get("/v1/documents", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
        assert anon.get("/v1/documents", headers={"X-API-Key": API_KEY}).status_code == 200
        assert anon.get("/v1/documents", headers={"X-API-Key": SECOND_KEY}).status_code == 200
        assert anon.get("/v1/documents", headers={"X-API-Key": json.dumps([API_KEY])}).status_code == 401


def test_metrics_expose_the_documented_names(client: httpx.Client) -> None:
    samples = [line for line in client.get("/metrics").text.splitlines() if not line.startswith("#")]
    for name in ("kvfuse_time_to_first_token_seconds", "kvfuse_inter_token_latency_seconds",
                 "kvfuse_request_queue_time_seconds", "kvfuse_e2e_request_latency_seconds", "kvfuse_retrieval_seconds",
                 "kvfuse_kv_load_seconds", "kvfuse_kv_cache_hit_tokens_total", "kvfuse_kv_cache_query_tokens_total",
                 "kvfuse_num_requests_running", "kvfuse_num_requests_waiting", "kvfuse_documents"):
        assert any(line.startswith(name) for line in samples), name
    assert metric(client, "kvfuse_documents") == 3 and metric(client, "kvfuse_kv_chunks") > 0


# -- documents ---------------------------------------------------------------------------------------------

def test_documents_are_listed_paginated_and_described(client: httpx.Client, essays3: dict[str, str]) -> None:
    page = client.get("/v1/documents", params={"offset": 0, "limit": 2}).json()
    assert page["total"] == 3 and len(page["documents"]) == 2
    rest = client.get("/v1/documents", params={"offset": 2, "limit": 2}).json()
    assert len(rest["documents"]) == 1
    assert {d["id"] for d in page["documents"] + rest["documents"]} == set(essays3)
    DocumentPage.model_validate(page)
    doc = client.get("/v1/documents/todo", params={"include_text": "true"}).json()
    DocumentOut.model_validate(doc)
    assert doc["status"] == "ready" and doc["chunks"] >= 2 and doc["tokens"] > 200 and doc["kv_bytes"] > 0
    assert doc["metadata"] == {"topic": "todo"} and doc["text"] == essays3["todo"]


def test_single_document_async_job_then_skip_and_content_hash_id(client: httpx.Client) -> None:
    text = "Kvfuse stores the KV cache of every chunk. The moon is made of basalt and dust."
    resp = client.post("/v1/documents", json={"text": text})
    assert resp.status_code == 202
    item = resp.json()
    assert item["document_id"].startswith("sha256-") and item["status"] in ("pending", "processing")
    deadline = time.monotonic() + 120
    while (job := client.get(f"/v1/jobs/{item['job_id']}").json())["status"] not in ("ready", "failed"):
        assert time.monotonic() < deadline, job
        time.sleep(0.3)
    assert job["status"] == "ready" and job["progress"]["chunks_done"] == job["progress"]["chunks_total"] == 1
    again = client.post("/v1/documents", json={"text": text})  # default on_conflict: skip
    assert again.status_code == 200 and again.json()["skipped"] is True
    assert client.delete(f"/v1/documents/{item['document_id']}").json()["deleted"] is True
    assert client.get(f"/v1/documents/{item['document_id']}").status_code == 404


# -- queries -----------------------------------------------------------------------------------------------

def test_query_streams_with_the_essay_as_first_source(client: httpx.Client) -> None:
    with client.stream("POST", "/v1/query", json={"query": QUESTION, "stream": True, "max_tokens": 12}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = read_stream(resp)
    names = [e for e, _ in events]
    assert names[0] == "sources" and names[-2] == "done" and events[-1] == (None, "[DONE]")
    sources = events[0][1]["sources"]
    assert sources[0]["document_id"] == "todo"
    tokens = [d["text"] for e, d in events if e == "token"]
    assert tokens and "".join(tokens).strip()
    done = events[-2][1]
    assert done["usage"]["completion_tokens"] >= 1 and done["usage"]["cached_tokens"] > 0
    assert set(done["timings"]) >= {"retrieval_ms", "kv_load_ms", "ttft_ms", "decode_ms", "total_ms"}
    assert done["fusion"] == {"method": "anchor", "recompute_ratio": 0.15, "ratio_source": "config",
                              "size_bucket": None}  # the configured default
    # The first and last events are the documented models; the last is a whole answer.
    QuerySources.model_validate(events[0][1])
    assert QueryAnswer.model_validate(done).sources == QuerySources.model_validate(events[0][1]).sources


def test_query_json_with_explicit_documents_and_fusion_method(client: httpx.Client) -> None:
    resp = client.post("/v1/query", json={"query": QUESTION, "document_ids": ["nft", "todo"], "max_tokens": 6,
                                          "fusion": {"method": "epic", "recompute_ratio": 0.2}})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["answer"].strip()
    # Exactly those documents' chunks, in that order.
    doc_order = [s["document_id"] for s in body["sources"]]
    n_nft = client.get("/v1/documents/nft").json()["chunks"]
    assert doc_order == ["nft"] * n_nft + ["todo"] * (len(doc_order) - n_nft)
    assert [s["chunk_index"] for s in body["sources"][:n_nft]] == list(range(n_nft))
    assert body["fusion"] == {"method": "epic", "recompute_ratio": 0.2, "ratio_source": "request", "size_bucket": None}
    u = body["usage"]
    assert u["prompt_tokens"] > u["cached_tokens"] > 0 and u["recomputed_tokens"] > 0
    assert u["prompt_tokens"] > u["context_tokens"] > u["recomputed_tokens"]  # the documents' tokens


def test_query_with_eviction_answers(client: httpx.Client) -> None:
    resp = client.post("/v1/query", json={"query": QUESTION, "document_ids": ["nft", "todo"], "max_tokens": 6,
                                          "fusion": {"method": "a3", "evict_capacity": 64}})
    assert resp.status_code == 200, resp.text
    assert resp.json()["answer"].strip() and resp.json()["usage"]["completion_tokens"] >= 1


def test_query_with_samkv_reads_blocks_from_the_store(client: httpx.Client) -> None:
    """samkv through REST and the OpenAI route: the worker reads the chunks block by block from the store
    (their blobs carry the ingest-time artifacts) and answers."""
    resp = client.post("/v1/query", json={"query": QUESTION, "document_ids": ["nft", "todo"], "max_tokens": 6,
                                          "fusion": {"method": "samkv"}})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["answer"].strip() and body["fusion"]["method"] == "samkv"
    assert body["usage"]["recomputed_tokens"] > 0
    bad = client.post("/v1/query", json={"query": QUESTION, "fusion": {"method": "samkv", "samkv_update": "blend"}})
    assert bad.status_code == 422, bad.text
    oa = client.post("/v1/chat/completions", json={"model": "kvfuse", "max_tokens": 4, "fusion": {"method": "samkv"},
                                                   "messages": [{"role": "user", "content": QUESTION}]})
    assert oa.status_code == 200, oa.text
    assert oa.json()["fusion"]["method"] == "samkv"


def test_a_real_answer_is_what_the_openapi_schema_says(client: httpx.Client) -> None:
    spec = client.get("/openapi.json")
    assert spec.status_code == 200, spec.text
    schemas = spec.json()["components"]["schemas"]
    ok = spec.json()["paths"]["/v1/query"]["post"]["responses"]["200"]["content"]["application/json"]
    assert ok["schema"]["$ref"] == "#/components/schemas/QueryAnswer"
    resp = client.post("/v1/query", json={"query": QUESTION, "max_tokens": 4})
    assert resp.status_code == 200, resp.text
    answer = QueryAnswer.model_validate_json(resp.content, strict=True)
    body = resp.json()
    # Every field of the model is in the body and nothing else: the model is the whole contract. A field
    # left out when it is None (exists only in some answers: responses._optional) may be absent.
    from kvfuse.service.api import responses

    for name, model in (("QueryAnswer", body), ("Usage", body["usage"]), ("Timings", body["timings"]),
                        ("FusionUsed", body["fusion"]), ("Source", body["sources"][0])):
        fields = getattr(responses, name).model_fields
        occasional = {f for f, info in fields.items() if info.exclude_if is not None}
        assert set(model) <= set(schemas[name]["properties"]) == set(fields), name
        assert set(schemas[name]["properties"]) - set(model) <= occasional, name
        assert set(schemas[name]["required"]) <= set(model), name
    assert answer.answer == body["answer"] and answer.usage.prompt_tokens > answer.usage.cached_tokens > 0


def test_openai_client_non_stream_and_stream(holder: Holder) -> None:
    from openai import OpenAI

    oa = OpenAI(base_url=holder.server.url + "/v1", api_key=API_KEY, timeout=180)
    models = [m.id for m in oa.models.list()]
    assert "kvfuse" in models
    resp = oa.chat.completions.create(model=models[0], messages=[{"role": "user", "content": QUESTION}],
                                      max_tokens=8)
    assert resp.choices[0].message.content.strip()
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.prompt_tokens_details.cached_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.model_extra["sources"][0]["document_id"] == "todo"

    stream = oa.chat.completions.create(model="kvfuse", messages=[{"role": "user", "content": QUESTION}],
                                        max_tokens=8, stream=True, stream_options={"include_usage": True})
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text.strip() and finish in ("stop", "length")
    assert usage is not None and usage.prompt_tokens_details.cached_tokens > 0


# -- bad input ---------------------------------------------------------------------------------------------

BIG = "word " * 45_000  # 225 kB: over max_body_bytes (200 kB)
LONG_DOC = "x" * 150_000  # under the body limit as raw text, over max_document_chars (100k)
Q = {"query": QUESTION}

# (name, method, path, request kwargs, expected status, expected error code)
BAD_INPUTS = [
    ("empty text", "POST", "/v1/documents", {"json": {"text": ""}}, 422, "empty_document"),
    ("whitespace text", "POST", "/v1/documents", {"json": {"text": " \n\t "}}, 422, "empty_document"),
    ("non-utf8 upload", "POST", "/v1/documents?id=bin",
     {"content": b"caf\xe9 \xff\xfe", "headers": {"Content-Type": "text/plain"}}, 400, "invalid_encoding"),
    ("non-utf8 json", "POST", "/v1/documents",
     {"content": b'{"text": "caf\xe9"}', "headers": {"Content-Type": "application/json"}}, 400, "invalid_encoding"),
    ("malformed json", "POST", "/v1/documents",
     {"content": b'{"text": ', "headers": {"Content-Type": "application/json"}}, 400, "invalid_json"),
    ("empty body", "POST", "/v1/query", {"content": b"", "headers": {"Content-Type": "application/json"}},
     400, "invalid_json"),
    ("oversized body", "POST", "/v1/documents", {"json": {"text": BIG}}, 413, "body_too_large"),
    ("oversized document", "POST", "/v1/documents?id=long",
     {"content": LONG_DOC.encode(), "headers": {"Content-Type": "text/plain"}}, 413, "document_too_large"),
    ("batch too large", "POST", "/v1/documents",
     {"json": {"documents": [{"id": f"d{i}", "text": "hi there"} for i in range(9)]}}, 413, "batch_too_large"),
    ("text not a string", "POST", "/v1/documents", {"json": {"text": 123}}, 422, "invalid_value"),
    ("body not an object", "POST", "/v1/documents", {"json": ["text"]}, 422, "invalid_type"),
    ("unknown document field", "POST", "/v1/documents", {"json": {"text": "hi", "title": "x"}}, 422,
     "invalid_value"),
    ("bad id characters", "POST", "/v1/documents", {"json": {"id": "a/b c", "text": "hi"}}, 422, "invalid_value"),
    ("bad on_conflict", "POST", "/v1/documents", {"json": {"text": "hi", "on_conflict": "merge"}}, 422,
     "invalid_value"),
    ("duplicate ids in batch", "POST", "/v1/documents",
     {"json": {"documents": [{"id": "dup", "text": "a b"}, {"id": "dup", "text": "c d"}]}}, 422, "duplicate_id"),
    ("half-bad batch writes nothing", "POST", "/v1/documents",
     {"json": {"documents": [{"id": "fine", "text": "good text"}, {"id": "bad", "text": "  "}]}}, 422,
     "empty_document"),
    ("duplicate id with fail", "POST", "/v1/documents", {"json": {"id": "todo", "text": "x", "on_conflict": "fail"}},
     409, "document_exists"),
    ("unsupported content type", "POST", "/v1/documents",
     {"content": b"<doc/>", "headers": {"Content-Type": "application/xml"}}, 415, "unsupported_media_type"),
    ("unknown document", "GET", "/v1/documents/nope", {}, 404, "document_not_found"),
    ("delete unknown document", "DELETE", "/v1/documents/nope", {}, 404, "document_not_found"),
    ("unknown job", "GET", "/v1/jobs/job-nope", {}, 404, "job_not_found"),
    ("bad page limit", "GET", "/v1/documents?limit=0", {}, 422, "invalid_value"),
    ("unknown route", "GET", "/v1/nothing", {}, 404, "not_found"),
    ("wrong method", "PUT", "/v1/query", {"json": Q}, 405, "method_not_allowed"),
    ("whitespace query", "POST", "/v1/query", {"json": {"query": "   "}}, 422, "empty_query"),
    ("unknown query field", "POST", "/v1/query", {"json": {**Q, "k": 3}}, 422, "invalid_value"),
    ("query is a number", "POST", "/v1/query", {"json": {"query": 5}}, 422, "invalid_value"),
    ("malformed stream flag", "POST", "/v1/query", {"json": {**Q, "stream": "yes"}}, 422, "invalid_value"),
    ("unknown fusion method", "POST", "/v1/query", {"json": {**Q, "fusion": {"method": "magic"}}}, 422,
     "unknown_fusion_method"),
    ("ratio above 1", "POST", "/v1/query", {"json": {**Q, "fusion": {"recompute_ratio": 1.5}}}, 422,
     "invalid_value"),
    ("ratio below 0", "POST", "/v1/query", {"json": {**Q, "fusion": {"recompute_ratio": -0.1}}}, 422,
     "invalid_value"),
    ("evict capacity below 0", "POST", "/v1/query", {"json": {**Q, "fusion": {"evict_capacity": -1}}}, 422,
     "invalid_value"),
    ("evict capacity not an integer", "POST", "/v1/query", {"json": {**Q, "fusion": {"evict_capacity": 1.5}}},
     422, "invalid_value"),
    ("check layer past the model", "POST", "/v1/query", {"json": {**Q, "fusion": {"check_layer": 99}}}, 422,
     "invalid_value"),
    ("top_k 0", "POST", "/v1/query", {"json": {**Q, "top_k": 0}}, 422, "invalid_value"),
    ("top_k huge", "POST", "/v1/query", {"json": {**Q, "top_k": 100_000}}, 422, "invalid_value"),
    ("max_tokens 0", "POST", "/v1/query", {"json": {**Q, "max_tokens": 0}}, 422, "invalid_value"),
    ("max_tokens over the limit", "POST", "/v1/query", {"json": {**Q, "max_tokens": 1_000_000}}, 422,
     "invalid_value"),
    ("max_tokens beyond the context", "POST", "/v1/query", {"json": {**Q, "max_tokens": MAX_CONTEXT}}, 400,
     "max_tokens_overflow"),
    ("unknown document_ids", "POST", "/v1/query", {"json": {**Q, "document_ids": ["todo", "nope"]}}, 404,
     "document_not_found"),
    ("duplicate document_ids", "POST", "/v1/query", {"json": {**Q, "document_ids": ["todo", "todo"]}}, 422,
     "invalid_value"),
    ("empty document_ids", "POST", "/v1/query", {"json": {**Q, "document_ids": []}}, 422, "invalid_value"),
    ("filters match nothing", "POST", "/v1/query", {"json": {**Q, "filters": {"topic": "none"}}}, 404,
     "no_documents"),
    ("chat without user message", "POST", "/v1/chat/completions",
     {"json": {"model": "kvfuse", "messages": [{"role": "system", "content": "hi"}]}}, 400, "invalid_value"),
    ("chat unknown model", "POST", "/v1/chat/completions",
     {"json": {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}}, 404, "model_not_found"),
    ("chat n over server.max_choices", "POST", "/v1/chat/completions",
     {"json": {"model": "kvfuse", "n": 9, "messages": [{"role": "user", "content": "hi"}]}}, 400, "invalid_value"),
]


@pytest.mark.parametrize(("method", "path", "kwargs", "status", "code"), [c[1:] for c in BAD_INPUTS],
                         ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_status_and_error_body(client: httpx.Client, method: str, path: str, kwargs: dict,
                                              status: int, code: str) -> None:
    resp = client.request(method, path, **kwargs)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == code and err["message"] and err["type"]
    assert set(err) == {"message", "type", "param", "code"}


def test_explicit_documents_overflowing_the_context_get_400_with_the_excess(client: httpx.Client) -> None:
    resp = client.post("/v1/query", json={**Q, "document_ids": ["nft", "todo", "pow"], "max_tokens": 400})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["code"] == "context_overflow" and err["param"] == "document_ids"
    assert " tokens too many" in err["message"]


def test_retrieved_chunks_that_do_not_fit_are_dropped_lowest_score_first(client: httpx.Client) -> None:
    body = {**Q, "top_k": 12, "max_tokens": 500, "stream": True}
    with client.stream("POST", "/v1/query", json=body) as resp:
        assert resp.status_code == 200
        event, first = next((e, json.loads(d)) for e, d in _events(resp))
    # Leaving after the sources event cancels the (long) generation.
    assert event == "sources"
    assert first["dropped_sources"] and "did not fit" in first["warning"]
    assert min(s["score"] for s in first["sources"]) >= max(s["score"] for s in first["dropped_sources"])


def _events(resp: httpx.Response):
    from service_helpers import sse_events

    return sse_events(resp)


def test_bad_inputs_wrote_nothing(client: httpx.Client, essays3: dict[str, str]) -> None:
    docs = snapshot(client)
    assert [d[0] for d in docs] == sorted(essays3)
    assert all(d[1] == "ready" for d in docs)
    assert metric(client, "kvfuse_documents") == 3


# -- uploads and the CLI -----------------------------------------------------------------------------------

def test_plain_text_upload_waits_until_ready(client: httpx.Client) -> None:
    text = "Plain uploads are documents too. Their id comes from the query string."
    resp = client.post("/v1/documents?wait=true&id=plain-1", content=text.encode(),
                       headers={"Content-Type": "text/plain; charset=utf-8"})
    assert resp.status_code == 201, resp.text
    assert resp.json()["status"] == "ready"
    assert client.get("/v1/documents/plain-1", params={"include_text": "true"}).json()["text"] == text
    assert client.delete("/v1/documents/plain-1").status_code == 200


def test_cli_ingest_and_query_against_the_server(holder: Holder, client: httpx.Client, tmp_path) -> None:
    folder = tmp_path / "docs"
    (folder / "more").mkdir(parents=True)
    (folder / "lighthouse.txt").write_text("The lighthouse keeper on Skerry Island paints the tower green "
                                           "every spring.", encoding="utf-8")
    (folder / "more" / "bakery.md").write_text("The bakery on Elm Street sells rye bread on Tuesdays.",
                                               encoding="utf-8")
    (folder / "more" / "binary.txt").write_bytes(b"\xff\xfe not text")
    base = [sys.executable, "-m", "kvfuse.cli"]
    auth = ["--url", holder.server.url, "--api-key", API_KEY]
    out = subprocess.run([*base, "ingest", str(folder), *auth], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 1, out.stderr  # one file was not UTF-8
    assert "not UTF-8" in out.stderr and "2 of 3 documents ingested" in out.stdout
    assert client.get("/v1/documents/lighthouse").json()["status"] == "ready"
    out = subprocess.run([*base, "query", "What color is the lighthouse tower painted?", "--doc", "lighthouse",
                          "--method", "cacheblend", "--ratio", "0.3", "--max-tokens", "8", *auth], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    answer, _, tail = out.stdout.partition("sources:")
    assert answer.strip()
    assert "lighthouse #0" in tail and "ttft" in tail and "fusion cacheblend r=0.3" in tail
    for doc_id in ("lighthouse", "bakery"):
        assert client.delete(f"/v1/documents/{doc_id}").status_code == 200


# -- cancellation, deletion, concurrency, crashes, restarts -------------------------------------------------

def _wait_metric(client: httpx.Client, name: str, value: float, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while (v := metric(client, name)) != value and time.monotonic() < deadline:
        time.sleep(0.1)
    return v


def test_client_disconnect_cancels_generation(client: httpx.Client) -> None:
    cancelled_before = metric(client, 'kvfuse_requests_total{outcome="cancelled"}')
    body = {"query": LONG_QUESTION, "system_prompt": LONG_SYSTEM, "document_ids": ["todo"], "max_tokens": 400,
            "stream": True}
    with client.stream("POST", "/v1/query", json=body) as resp:
        for event, _ in _events(resp):
            if event == "token":
                break  # generation is under way: leave
    assert _wait_metric(client, "kvfuse_num_requests_running", 0, timeout=15) == 0
    assert _wait_metric(client, 'kvfuse_requests_total{outcome="cancelled"}', cancelled_before + 1, 5) == \
        cancelled_before + 1


def test_delete_during_a_query(client: httpx.Client) -> None:
    text = ("Weird people are those who do not conform. Most people are not weird. Weird ideas sometimes "
            "turn out to be right, and then they stop seeming weird. ") * 4
    ingest(client, [{"id": "weird", "text": text}])
    body = {"query": "What is weird?", "document_ids": ["weird"], "max_tokens": 24, "stream": True}
    with client.stream("POST", "/v1/query", json=body) as resp:
        events = _events(resp)
        assert next(events)[0] == "sources"
        deleted = client.delete("/v1/documents/weird")
        rest = [(e, d) for e, d in events]
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    # The running query finishes from what it had; the document is gone everywhere after.
    assert rest[-1] == (None, "[DONE]") and rest[-2][0] == "done"
    assert client.get("/v1/documents/weird").status_code == 404
    assert client.post("/v1/query", json={**Q, "document_ids": ["weird"]}).status_code == 404
    found = client.post("/v1/query", json={"query": "What is weird?", "top_k": 4, "max_tokens": 1}).json()
    assert "weird" not in {s["document_id"] for s in found["sources"]}
    assert metric(client, "kvfuse_documents") == 3


def test_16_concurrent_streams_each_complete_or_get_429(holder: Holder) -> None:
    results: list[tuple[int, object]] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        with make_client(holder.server, timeout=240) as c:
            body = {"query": f"{QUESTION} ({i})", "max_tokens": 4, "stream": True}
            with c.stream("POST", "/v1/query", json=body) as resp:
                if resp.status_code == 200:
                    out: object = read_stream(resp)
                else:
                    resp.read()
                    out = (resp.headers.get("retry-after"), resp.json())
            with lock:
                results.append((resp.status_code, out))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert len(results) == 16
    ok = [r for s, r in results if s == 200]
    rejected = [r for s, r in results if s == 429]
    assert len(ok) + len(rejected) == 16 and ok
    for events in ok:
        assert events[0][0] == "sources" and events[-2][0] == "done" and events[-1] == (None, "[DONE]")
    for retry_after, err in rejected:
        assert retry_after is not None and err["error"]["code"] == "queue_full"


def test_worker_killed_mid_stream_errors_cleanly_and_the_next_request_succeeds(holder: Holder,
                                                                                client: httpx.Client) -> None:
    before = client.get("/health").json()["worker"]
    body = {"query": LONG_QUESTION, "system_prompt": LONG_SYSTEM, "document_ids": ["nft"], "max_tokens": 400,
            "stream": True}
    with client.stream("POST", "/v1/query", json=body) as resp:
        events = _events(resp)
        for event, _ in events:
            if event == "token":
                os.kill(before["pid"], signal.SIGKILL)
                break
        rest = [(e, d) for e, d in events]
    assert rest[-1] == (None, "[DONE]")
    assert rest[-2][0] == "error", rest[-3:]
    err = json.loads(rest[-2][1])
    assert err["status"] == 503 and err["error"]["code"] == "worker_crashed"
    assert "it is being restarted" in err["error"]["message"]  # a local worker is (a fleet's is not)
    holder.server.wait_ready(timeout=240)
    after = client.get("/health").json()["worker"]
    assert after["pid"] != before["pid"] and after["restarts"] == before["restarts"] + 1
    resp = client.post("/v1/query", json={**Q, "max_tokens": 4})
    assert resp.status_code == 200 and resp.json()["answer"].strip()


def test_corrupt_blob_is_rebuilt_from_the_tokens_at_query_time(holder: Holder, client: httpx.Client) -> None:
    from kvfuse.store.lmdb_env import LmdbEnv

    text = "The sun is a star. It is about 4.6 billion years old and will shine for billions more."
    # Alone in its collection, its one chunk has no neighbour to be cached after: a cache of the chunk
    # alone, which a query rebuilds and stores again (one computed after a context is rebuilt after the
    # context its record names: tests/service/worker/test_first_use.py).
    ingest(client, [{"id": "sun", "text": text, "collection": "sun"}])
    rebuilt = metric(client, "kvfuse_rebuilt_chunks_total")
    rec = _record(holder, "sun")
    assert not any(rec.chunk_contexts)  # cached alone
    key = rec.chunk_keys[0]
    env = LmdbEnv(holder.server.data_dir / "lmdb", map_size=1 << 30, max_readers=16)
    try:
        def flip(txn):  # damage the payload in place: same size, wrong bytes
            blob = bytearray(txn.get(key.encode(), db=env.db("chunks")))
            blob[-100:] = bytes(100)
            txn.put(key.encode(), bytes(blob), db=env.db("chunks"))

        env.write(flip)
    finally:
        env.close()
    # vanilla prefills from the tokens: it never reads the blob, so it neither fails nor rebuilds it
    resp = client.post("/v1/query", json={**Q, "document_ids": ["sun"], "max_tokens": 2,
                                          "fusion": {"method": "vanilla"}})
    assert resp.status_code == 200, resp.text
    assert metric(client, "kvfuse_rebuilt_chunks_total") == rebuilt
    for _ in range(2):
        resp = client.post("/v1/query", json={**Q, "document_ids": ["sun"], "max_tokens": 2})
        assert resp.status_code == 200, resp.text
    assert metric(client, "kvfuse_rebuilt_chunks_total") == rebuilt + 1  # rebuilt once, then stored again
    # the second query read the stored copy again: counted under the tier that served it
    assert metric(client, 'kvfuse_kv_tier_reads_total{tier="lmdb"}') >= 1
    assert metric(client, 'kvfuse_kv_tier_bytes{tier="lmdb"}') > 0  # what the tier holds, as last reported
    assert client.delete("/v1/documents/sun").status_code == 200


def _record(holder: Holder, doc_id: str) -> Any:
    from kvfuse.store.lmdb_env import LmdbEnv
    from kvfuse.store.records import DocumentRecord

    env = LmdbEnv(holder.server.data_dir / "lmdb", map_size=1 << 30, max_readers=16, readonly=True)
    try:
        with env.read() as txn:
            return DocumentRecord.from_json(txn.get(doc_id.encode(), db=env.db("docs")))
    finally:
        env.close()


def test_worker_killed_during_ingestion_fails_the_job_and_rolls_back(client: httpx.Client,
                                                                     essays: list[tuple[str, str]]) -> None:
    text = "\n\n".join(t for _, t in essays[:4])[:12_000]  # ~24 chunks of 128 tokens: 6 precompute jobs
    chunks_before, bytes_before = metric(client, "kvfuse_kv_chunks"), metric(client, "kvfuse_kv_bytes")
    pid = client.get("/health").json()["worker"]["pid"]
    job = client.post("/v1/documents", json={"id": "big", "text": text}).json()
    deadline = time.monotonic() + 240
    while (j := client.get(f"/v1/jobs/{job['job_id']}").json())["progress"]["chunks_done"] < 4:
        assert j["status"] in ("pending", "processing") and time.monotonic() < deadline, j
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)  # a precompute job is in flight
    while (j := client.get(f"/v1/jobs/{job['job_id']}").json())["status"] in ("pending", "processing"):
        assert time.monotonic() < deadline, j
        time.sleep(0.1)
    assert j["status"] == "failed" and "worker crashed" in j["error"]
    doc = client.get("/v1/documents/big").json()
    assert doc["status"] == "failed" and doc["chunks"] == 0 and doc["kv_bytes"] == 0 and "worker" in doc["error"]
    assert metric(client, "kvfuse_kv_chunks") == chunks_before and metric(client, "kvfuse_kv_bytes") == bytes_before
    found = client.post("/v1/query", json={"query": text[:200], "top_k": 3, "max_tokens": 1})
    assert found.status_code == 200 and "big" not in {s["document_id"] for s in found.json()["sources"]}
    assert client.delete("/v1/documents/big").status_code == 200
    assert metric(client, "kvfuse_documents") == 3


def test_restart_on_the_same_data_dir_serves_every_ready_document_without_reingesting(holder: Holder) -> None:
    with make_client(holder.server) as c:
        before = snapshot(c)
    # uvicorn re-raises the SIGTERM it handled once shutdown is complete.
    assert holder.server.stop() in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in holder.server.log_tail()
    holder.server = ServerProcess(holder.server.data_dir, holder.server.log_path, **SERVER_ENV).start()
    with make_client(holder.server) as c:
        assert snapshot(c) == before  # same documents, same status, untouched (updated_at)
        for doc_id, *_ in before:
            resp = c.post("/v1/query", json={**Q, "document_ids": [doc_id], "max_tokens": 2})
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["cached_tokens"] > 0
        assert metric(c, "kvfuse_precomputed_chunks_total") == 0  # nothing was computed again
        assert metric(c, "kvfuse_rebuilt_chunks_total") == 0
