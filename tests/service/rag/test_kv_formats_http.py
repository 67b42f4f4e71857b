"""A store converted to another KV format while it holds documents, through real servers: documents
ingested in float16, `kvfuse store convert --kv-dtype int8` stopped after one chunk (a store in two
formats) and run again to the end, a server started between and after. Every document answers at each
step from its stored chunks, whichever format they are in (nothing rebuilt, nothing counted as another
model's), the chunks read are counted by the reload-or-recompute plan, and after `store.kv_dtype`
changes new documents are stored in the new format."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from service_helpers import API_KEY, REPO, ServerProcess, ingest, make_client, metric, store_check
from test_precompute_context_http import _stored

pytestmark = pytest.mark.slow

ENV = {"KVFUSE_SERVER__API_KEYS": API_KEY, "KVFUSE_RETRIEVER__CHUNK_TOKENS": "96", "KVFUSE_REDIS_URL": "",
       "KVFUSE_STORE__PRECOMPUTE_CONTEXT": "none", "KVFUSE_GENERATION__MAX_TOKENS": "4"}


def _convert(data: Path, *args: str) -> dict:
    env = {**os.environ, "KVFUSE_DATA_DIR": str(data), "KVFUSE_REDIS_URL": ""}
    env.pop("KVFUSE_CONFIG", None)
    out = subprocess.run([sys.executable, "-m", "kvfuse.cli", "store", "convert", "--json", *args], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _sources(client: httpx.Client) -> dict[str, float]:
    """kvfuse_kv_chunk_sources_total by "source:reason"."""
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("kvfuse_kv_chunk_sources_total{"):
            labels = dict(p.split("=") for p in line[line.index("{") + 1 : line.index("}")].split(","))
            out[f"{labels['source'].strip(chr(34))}:{labels['reason'].strip(chr(34))}"] = float(line.split()[-1])
    return out


def _answers(server: ServerProcess, docs: list[str]) -> dict[str, float]:
    with make_client(server) as c:
        for doc in docs:
            resp = c.post("/v1/query", json={"query": "What is this about?", "document_ids": [doc]})
            assert resp.status_code == 200, resp.text
            assert resp.json()["answer"].strip()
        assert metric(c, "kvfuse_rebuilt_chunks_total") == 0
        assert metric(c, "kvfuse_kv_fingerprint_misses_total") == 0
        return _sources(c)


def test_documents_answer_through_a_convert_stopped_half_way_and_finished(tmp_path: Path, essays3) -> None:
    data = tmp_path / "data"
    server = ServerProcess(data, tmp_path / "f16.log", KVFUSE_STORE__KV_DTYPE="float16", **ENV).start()
    try:
        with make_client(server) as c:
            ingest(c, [{"id": "pow", "text": essays3["pow"][:700]}, {"id": "nft", "text": essays3["nft"][:400]}])
    finally:
        server.stop()
    chunks = sum(len(_stored(data, d)[0].chunk_keys) for d in ("pow", "nft"))
    assert chunks >= 3

    first = _convert(data, "--kv-dtype", "int8", "--limit", "1", "--batch", "1")
    assert first["converted"] == 1 and first["remaining"] == chunks - 1
    assert {h.dtype for d in ("pow", "nft") for _, _, h in _stored(data, d)[1]} == {"float16", "int8"}
    server = ServerProcess(data, tmp_path / "mixed.log", KVFUSE_STORE__KV_DTYPE="float16", **ENV).start()
    try:
        read = _answers(server, ["pow", "nft"])
        assert sum(n for k, n in read.items() if k.startswith("read:")) == chunks and not any(
            k.startswith("recompute:") for k in read)
    finally:
        server.stop()

    assert _convert(data, "--kv-dtype", "int8")["converted"] == chunks - 1
    assert store_check(data)["problems"] == 0
    server = ServerProcess(data, tmp_path / "int8.log", KVFUSE_STORE__KV_DTYPE="int8", **ENV).start()
    try:
        _answers(server, ["pow", "nft"])
        with make_client(server) as c:
            ingest(c, [{"id": "new", "text": "A later note. " + essays3["nft"][:300]}])
    finally:
        server.stop()
    for doc in ("pow", "nft", "new"):
        assert {h.dtype for _, _, h in _stored(data, doc)[1]} == {"int8"}
