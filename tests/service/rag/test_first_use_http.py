"""`precompute_at: first_use` through a real server over HTTP (docs/DESIGN.md, "KV when it pays"):

- a document ingested with `precompute_at: first_use` is ready with none of its chunks' KV (GET says so,
  and its job), the record names each chunk's context;
- the first query over it, asked to (`fusion.cold_chunks: compute`), computes its chunks within its load, all at once, reports them in its usage
  and timings and in kvfuse_kv_chunk_sources_total{reason="first_use"}, and writes them back: GET then
  counts them, and the next query reads them all and answers the same;
- by default (`fusion.cold_chunks: auto`) a query whose chunks are all cold, each after a context longer
  than itself, is answered by a full prefill (vanilla's answer; `fusion.method` says vanilla, the request's
  method beside it), its chunks computed afterwards (`chunks_deferred`, reason="deferred"), and the next
  query reads them all;
- the same text ingested eagerly into another collection finds every chunk already stored: first use
  stored the very keys (chunk and context) eager ingestion computes;
- POST /v1/documents/{id}/precompute computes a first-use document's chunks ahead (a query then computes
  none), POST /v1/collections/{name}/precompute a collection's; unknown ones are 404.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from service_helpers import API_KEY, ServerProcess, ingest, make_client

from kvfuse.store.records import DocumentRecord

pytestmark = pytest.mark.slow

ENV = {"KVFUSE_SERVER__API_KEYS": API_KEY, "KVFUSE_RETRIEVER__CHUNK_TOKENS": "96",
       "KVFUSE_STORE__PRECOMPUTE_CONTEXT_TOKENS": "160", "KVFUSE_GENERATION__MAX_TOKENS": "6"}


def _sources(client: httpx.Client, reason: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("kvfuse_kv_chunk_sources_total{") and f'reason="{reason}"' in line:
            return float(line.split()[-1])
    return 0.0


def _ask(client: httpx.Client, doc_id: str, **fusion: str) -> dict:
    body = {"query": "What is this essay about?", "document_ids": [doc_id]}
    if fusion:
        body["fusion"] = fusion
    resp = client.post("/v1/query", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_first_use_documents_are_ready_without_kv_and_queries_compute_and_keep_it(
        tmp_path: Path, essays3: dict[str, str]) -> None:
    text = essays3["todo"][:1500]
    data = tmp_path / "data"
    server = ServerProcess(data, tmp_path / "server.log", **ENV).start()
    try:
        with make_client(server) as c:
            done = ingest(c, [{"id": "lazy", "text": text, "collection": "a", "precompute_at": "first_use"},
                              {"id": "ahead", "text": essays3["pow"][:900], "collection": "b",
                               "precompute_at": "first_use"}])
            assert [d["status"] for d in done["documents"]] == ["ready", "ready"], done
            doc = c.get("/v1/documents/lazy").json()
            n = doc["chunks"]
            assert n >= 3 and doc["kv_chunks"] == 0 and doc["precompute_at"] == "first_use", doc
            assert c.get(f"/v1/jobs/{done['documents'][0]['job_id']}").json()["kv_chunks"] == 0

            cold = _ask(c, "lazy", cold_chunks="compute")
            assert cold["fusion"]["method"] == "anchor" and "requested_method" not in cold["fusion"]
            assert cold["usage"]["chunks_computed"] == n and cold["usage"]["chunks_read"] == 0, cold["usage"]
            assert cold["usage"]["cached_tokens"] < cold["usage"]["context_tokens"]
            assert 0 < cold["timings"]["kv_compute_ms"] <= cold["timings"]["kv_load_ms"]
            assert _sources(c, "first_use") == n
            assert c.get("/v1/documents/lazy").json()["kv_chunks"] == n
            warm = _ask(c, "lazy")
            assert warm["usage"]["chunks_computed"] == 0 and warm["usage"]["chunks_read"] == n, warm["usage"]
            assert warm["answer"] == cold["answer"]  # what it computed is what it now reads
            assert _sources(c, "first_use") == n

            # The default: a cold query answered by a full prefill, its chunks computed after it.
            ingest(c, [{"id": "later", "text": essays3["nft"][:1200], "collection": "d",
                        "precompute_at": "first_use"}])
            m = c.get("/v1/documents/later").json()["chunks"]
            vanilla = _ask(c, "later", method="vanilla")
            first = _ask(c, "later")
            assert first["fusion"]["method"] == "vanilla" and first["fusion"]["requested_method"] == "anchor"
            assert first["usage"]["chunks_deferred"] == m and first["usage"]["cached_tokens"] == 0, first["usage"]
            assert first["answer"] == vanilla["answer"]
            deadline = time.monotonic() + 120
            while c.get("/v1/documents/later").json()["kv_chunks"] < m:  # computed at ingestion's share
                assert time.monotonic() < deadline, "the deferred chunks were never stored"
                time.sleep(0.2)
            assert _sources(c, "deferred") == m
            read = _ask(c, "later")
            assert read["fusion"]["method"] == "anchor" and read["usage"]["chunks_read"] == m, read["usage"]
            assert read["usage"]["chunks_computed"] == 0 and "chunks_deferred" not in read["usage"]

            # Eagerly, the same text elsewhere: every chunk key is already stored, none is computed.
            again = ingest(c, [{"id": "eager", "text": text, "collection": "c"}])["documents"][0]
            assert again["status"] == "ready" and again["progress"]["chunks_total"] == n
            eager = c.get("/v1/documents/eager").json()
            assert eager["kv_chunks"] == n and eager["precompute_at"] == "ingest"

            # Ahead of any query: the document's, then the collection's (nothing left to compute).
            warmed = c.post("/v1/documents/ahead/precompute")
            assert warmed.status_code == 200, warmed.text
            body = warmed.json()
            assert body["documents"] == ["ahead"] and body["computed"] == body["chunks"] == body["kv_chunks"] >= 2
            assert _ask(c, "ahead")["usage"]["chunks_computed"] == 0
            coll = c.post("/v1/collections/b/precompute").json()
            assert coll["computed"] == 0 and coll["kv_chunks"] == body["chunks"]
            assert c.post("/v1/documents/nope/precompute").status_code == 404
            assert c.post("/v1/collections/nope/precompute").status_code == 404
    finally:
        server.stop()

    from kvfuse.store.lmdb_env import LmdbEnv

    env = LmdbEnv(data / "lmdb", map_size=1 << 30, max_readers=16, readonly=True)
    try:
        with env.read() as txn:
            lazy = DocumentRecord.from_json(txn.get(b"lazy", db=env.db("docs")))
            eager_rec = DocumentRecord.from_json(txn.get(b"eager", db=env.db("docs")))
    finally:
        env.close()
    assert lazy.chunk_keys == eager_rec.chunk_keys  # the very keys eager ingestion computes
    assert len(lazy.chunk_context_src) == n and all("span" in s for s in lazy.chunk_context_src[1:])
