"""The labelled prompt through the service (`model.prompt_layout: labelled`, kvfuse/fusion/prompt.py): a
real server ingests over HTTP and the test reads back what it stored.

- Each chunk's stored cache is the one of its block as fused: "Document (title: T)\\n" + its text + a
  blank line, T the document's `title` metadata; the record keeps the text's own token counts (the
  document is still split by them), and the key names the block, so it is another cache than the plain
  chunk's.
- Sources carry the number each chunk has in the prompt (`label`, from 1); retrieved ones are listed
  best first and, with the default order (best-last), numbered from the other end.
- The layout changed back to plain and the server restarted: the labelled caches are never fused into
  the plain prompt (each chunk is a miss, rebuilt from its tokens).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from service_helpers import API_KEY, ServerProcess, ingest, make_client, metric
from test_precompute_context_http import _stored

from kvfuse import kvblob
from kvfuse.fusion.prompt import block_ids

pytestmark = pytest.mark.slow

ENV = {"KVFUSE_SERVER__API_KEYS": API_KEY, "KVFUSE_RETRIEVER__CHUNK_TOKENS": "96",
       "KVFUSE_STORE__KV_DTYPE": "float32", "KVFUSE_STORE__PRECOMPUTE_CONTEXT": "none",
       "KVFUSE_GENERATION__MAX_TOKENS": "4"}


def test_labelled_blocks_are_cached_numbered_and_never_fused_into_the_plain_prompt(
        tmp_path: Path, essays3: dict[str, str], default_llm_path: str) -> None:
    from kvfuse.fusion import FusionEngine
    from kvfuse.retriever import Chunker

    text = essays3["pow"][:900]
    data = tmp_path / "data"
    server = ServerProcess(data, tmp_path / "labelled.log", KVFUSE_MODEL__PROMPT_LAYOUT="labelled", **ENV).start()
    try:
        with make_client(server) as c:
            ingest(c, [{"id": "pow", "text": text, "metadata": {"title": "Power"}},
                       {"id": "nft", "text": essays3["nft"][:300]}])
            resp = c.post("/v1/query", json={"query": "What is this about?", "document_ids": ["pow", "nft"]})
            assert resp.status_code == 200, resp.text
            sources = resp.json()["sources"]
            assert [s["label"] for s in sources] == list(range(1, len(sources) + 1))
            assert [s["document_id"] for s in sources][-1] == "nft"
            # retrieved: listed best first, numbered by their place in the prompt (model.prompt_order:
            # best-last by default, so the top hit is the last, next to the question)
            resp = c.post("/v1/query", json={"query": "What is power?", "top_k": 3})
            assert resp.status_code == 200, resp.text
            hits = resp.json()["sources"]
            assert len(hits) == 3 and [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
            assert [h["label"] for h in hits] == [3, 2, 1]
    finally:
        server.stop()
    rec, blobs = _stored(data, "pow")
    chunker = Chunker.from_pretrained(default_llm_path, 96)
    raw = [ch.token_ids for ch in chunker.chunk(text)]
    assert len(raw) >= 2 and rec.chunk_tokens == [len(t) for t in raw]
    engine = FusionEngine.load(default_llm_path, dtype="float32")
    blocks = [block_ids(chunker.encode, t, "Power", "labelled") for t in raw]
    assert engine.tokenizer.decode(blocks[1]).startswith("Document (title: Power)\n")
    for ids, key, (k, v, header) in zip(blocks, rec.chunk_keys, blobs, strict=True):
        assert key == kvblob.chunk_key(engine.fingerprint, "float32", ids) == header.key
        want = engine.precompute([ids])[0]
        torch.testing.assert_close(k, want.k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v, want.v, atol=1e-4, rtol=1e-4)
    assert rec.chunk_keys[0] != kvblob.chunk_key(engine.fingerprint, "float32", raw[0])

    server = ServerProcess(data, tmp_path / "plain.log", KVFUSE_MODEL__PROMPT_LAYOUT="plain", **ENV).start()
    try:
        with make_client(server) as c:
            resp = c.post("/v1/query", json={"query": "What is this about?", "document_ids": ["pow"]})
            assert resp.status_code == 200, resp.text
            assert resp.json()["sources"][0]["tokens"] == len(raw[0])  # the plain chunk, no header
            assert metric(c, "kvfuse_kv_fingerprint_misses_total") == len(raw)
    finally:
        server.stop()
