"""`kvfuse serve` with a tiny saved model of each supported family (tests/tiny_models.py: random weights,
the default model's tokenizer): the worker's load check passes, a document is ingested, and a query is
fused with the default method and streamed over REST. Gemma 3's prompt is longer than its sliding
window. A model whose config asks for what the engine does not compute (Gemma 3 with
`use_bidirectional_attention`) never becomes ready: /ready says why, naming the layer."""

from __future__ import annotations

import time

import httpx
import pytest
import tiny_models
from service_helpers import API_KEY, ServerProcess, make_client, read_stream, serving

pytestmark = pytest.mark.slow

NOTE = ("The lighthouse keeper of Port Ellery logged the weather every morning and every evening for forty "
        "years, and the fishermen read his log before they went out. His daughter kept the log after him.")
QUESTION = "Who kept the log after the lighthouse keeper?"


def _env(path) -> dict[str, str]:
    # A models dir of the test's own, so no pass another test kept for the same tiny model skips the check.
    return {"KVFUSE_SERVER__API_KEYS": API_KEY, "KVFUSE_MODEL__LLM": str(path),
            "KVFUSE_MODEL_CACHE_DIR": str(path.parent / "models")}


@pytest.mark.parametrize("family", list(tiny_models.FAMILIES))
def test_each_family_is_checked_ingests_fuses_and_streams(family: str, tmp_path, default_llm_path) -> None:
    path = tiny_models.save(family, tmp_path / "model", default_llm_path)
    with serving(tmp_path, _env(path), {"note": NOTE}) as h, make_client(h.server) as client:
        body = {"query": QUESTION, "document_ids": ["note"], "stream": True, "max_tokens": 6}
        with client.stream("POST", "/v1/query", json=body) as resp:
            assert resp.status_code == 200, resp.read()
            events = read_stream(resp)
        log = h.server.log_tail(400)
    names = [e for e, _ in events]
    assert names[0] == "sources" and names[-2] == "done" and events[-1] == (None, "[DONE]"), events
    done = events[-2][1]
    assert done["fusion"]["method"] == "anchor" and done["usage"]["completion_tokens"] >= 1
    assert done["usage"]["cached_tokens"] > 0  # the stored chunk's KV was fused, not prefilled
    if family == "gemma3_text":
        assert done["usage"]["prompt_tokens"] > tiny_models.WINDOW
    assert "model check passed" in log


def test_a_model_the_engine_would_compute_wrong_is_refused_at_start(tmp_path, default_llm_path) -> None:
    path = tiny_models.save("gemma3_text", tmp_path / "model", default_llm_path, use_bidirectional_attention=True)
    server = ServerProcess(tmp_path / "data", tmp_path / "server.log", **_env(path)).start(wait=False)
    try:
        deadline = time.monotonic() + 300
        with make_client(server) as client:
            while True:
                try:
                    resp = client.get("/ready")
                except httpx.TransportError:  # the API is still starting
                    resp = None
                if resp is not None and "parts at layer 0" in resp.text:
                    break
                assert time.monotonic() < deadline, server.log_tail()
                time.sleep(1)
        assert resp.status_code == 503 and "refusing to serve it" in resp.text
        assert "model check FAILED" in server.log_tail(400)
    finally:
        server.stop()
