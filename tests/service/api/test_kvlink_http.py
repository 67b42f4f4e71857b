"""kvlink over real HTTP: with the artifact the package ships for the default model it answers, its link
slots counted in the usage; on a model without link embeddings, a clear 422 naming the command that trains
them (a real server whose artifact directory is empty)."""

from __future__ import annotations

import pytest
from service_helpers import API_KEY, ServerProcess, ingest, make_client

pytestmark = pytest.mark.slow


def test_kvlink_without_an_artifact_is_422_naming_the_training_command(tmp_path, essays3: dict[str, str]):
    empty = tmp_path / "no-artifacts"
    empty.mkdir()
    server = ServerProcess(tmp_path / "data", tmp_path / "server.log", KVFUSE_SERVER__API_KEYS=API_KEY,
                           KVFUSE_RETRIEVER__CHUNK_TOKENS="128", KVFUSE_MODEL__MAX_CONTEXT_TOKENS="1024",
                           KVFUSE_FUSION__KVLINK_DIR=str(empty)).start()
    try:
        with make_client(server) as c:
            ingest(c, [{"id": "todo", "text": essays3["todo"][:2000]}])
            body = {"query": "What did the nurse make a list of?", "document_ids": ["todo"], "max_tokens": 2,
                    "stream": False, "fusion": {"method": "kvlink", "link_tokens": 1}}
            resp = c.post("/v1/query", json=body)
            assert resp.status_code == 422, resp.text
            assert "kvfuse train kvlink" in resp.text
            # K = 0 needs no artifact: it is pie
            resp = c.post("/v1/query", json={**body, "fusion": {"method": "kvlink", "link_tokens": 0}})
            assert resp.status_code == 200, resp.text
    finally:
        server.stop()


def test_kvlink_answers_with_the_packaged_artifact(tmp_path, essays3: dict[str, str]):
    """Out of the box (fusion.kvlink_dir unset): the server finds the artifact installed with the package.
    Each of the N chunks is followed by K link rows, all computed: context and recomputed tokens are those
    of K = 0 (pie) plus N x K, for both trained link counts."""
    server = ServerProcess(tmp_path / "data", tmp_path / "server.log", KVFUSE_SERVER__API_KEYS=API_KEY,
                           KVFUSE_RETRIEVER__CHUNK_TOKENS="128", KVFUSE_MODEL__MAX_CONTEXT_TOKENS="1024").start()
    try:
        with make_client(server) as c:
            ingest(c, [{"id": "todo", "text": essays3["todo"][:2000]}])
            body = {"query": "What did the nurse make a list of?", "document_ids": ["todo"], "max_tokens": 4,
                    "stream": False}
            usage = {}
            for k in (0, 1, 5):
                resp = c.post("/v1/query", json={**body, "fusion": {"method": "kvlink", "link_tokens": k}})
                assert resp.status_code == 200, resp.text
                assert resp.json()["fusion"]["method"] == "kvlink"
                assert resp.json()["usage"]["completion_tokens"] >= 1
                usage[k] = resp.json()["usage"]
            n = len(resp.json()["sources"])
            assert n >= 2  # 2,000 characters in 128-token chunks
            for k in (1, 5):
                assert usage[k]["context_tokens"] == usage[0]["context_tokens"] + n * k
                assert usage[k]["recomputed_tokens"] == usage[0]["recomputed_tokens"] + n * k
    finally:
        server.stop()
