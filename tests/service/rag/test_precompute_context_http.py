"""Context-carrying chunk caches through the service (`store.precompute_context`,
kvfuse/service/rag/precompute_context.py): a real server ingests over HTTP, and the test reads back what it stored.

- `document`: each chunk's blob holds exactly the cache `FusionEngine.precompute_after` computes after
  the text before it in its document, keyed by chunk + context, and the document's record names each
  context; queries over it answer.
- The setting changed to `none` and the server restarted: the stored caches still serve (no chunk is
  taken for another model's, none is rebuilt).
- `neighbours`: a one-chunk document is computed after the most similar chunk of the other documents in
  the index, found with the real embedder.
- `document_or_neighbours` (the default): a one-chunk document as under `neighbours`; a longer document's
  chunks as under `document`, but its first, which takes its nearest chunk.
- Every mode (`none`, `document`, `neighbours`, `prefix`, `sink`) ingests a document and answers a query
  over it; under `prefix` every chunk is computed after the system prefix of `model.system_prompt`, under
  `sink` after the BOS token.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from service_helpers import API_KEY, ServerProcess, ingest, make_client, metric

from kvfuse import kvblob
from kvfuse.config import ModelSettings
from kvfuse.store.records import DocumentRecord

pytestmark = pytest.mark.slow

CHUNK_TOKENS = 96
BUDGET = 160
ENV = {"KVFUSE_SERVER__API_KEYS": API_KEY, "KVFUSE_RETRIEVER__CHUNK_TOKENS": str(CHUNK_TOKENS),
       "KVFUSE_STORE__PRECOMPUTE_CONTEXT_TOKENS": str(BUDGET), "KVFUSE_STORE__KV_DTYPE": "float32",
       "KVFUSE_STORE__PRECOMPUTE_NEIGHBOURS": "1", "KVFUSE_GENERATION__MAX_TOKENS": "4"}
SHORT = "The lighthouse keeper counted ships every night and wrote their names in a green notebook."
SHORT2 = "Most people regret the things they did not do more than the mistakes they made along the way."


def _stored(data_dir: Path, doc_id: str) -> tuple[DocumentRecord, list[tuple[torch.Tensor, torch.Tensor, kvblob.KVHeader]]]:
    from kvfuse.store.lmdb_env import LmdbEnv

    env = LmdbEnv(data_dir / "lmdb", map_size=1 << 30, max_readers=16, readonly=True)
    try:
        with env.read() as txn:
            rec = DocumentRecord.from_json(txn.get(doc_id.encode(), db=env.db("docs")))
            blobs = [kvblob.decode(txn.get(k.encode(), db=env.db("chunks")), copy=True) for k in rec.chunk_keys]
    finally:
        env.close()
    return rec, blobs


def _ask(client: httpx.Client, doc_id: str) -> None:
    resp = client.post("/v1/query", json={"query": "What is this about?", "document_ids": [doc_id]})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] > 0


def test_document_and_neighbour_contexts_over_http(tmp_path: Path, essays3: dict[str, str],
                                                   default_llm_path: str, default_embedder_path: str) -> None:
    from kvfuse.fusion import FusionEngine
    from kvfuse.fusion.chunk_context import document_contexts
    from kvfuse.retriever import Chunker, Embedder

    text = essays3["todo"][:2500]
    chunker = Chunker.from_pretrained(default_llm_path, CHUNK_TOKENS)
    chunks = [c.token_ids for c in chunker.chunk(text)]
    assert len(chunks) >= 3
    data = tmp_path / "data"

    server = ServerProcess(data, tmp_path / "document.log", KVFUSE_STORE__PRECOMPUTE_CONTEXT="document", **ENV).start()
    try:
        with make_client(server) as c:
            assert [d["status"] for d in ingest(c, [{"id": "todo", "text": text}])["documents"]] == ["ready"]
            _ask(c, "todo")
            assert c.post("/v1/query", json={"query": "What do people regret?"}).status_code == 200
    finally:
        server.stop()
    rec, blobs = _stored(data, "todo")
    contexts = document_contexts(chunks, BUDGET)
    assert rec.chunk_tokens == [len(ids) for ids in chunks]
    assert rec.chunk_contexts == [kvblob.context_hash(ctx) for ctx in contexts] and rec.chunk_contexts[0] == ""
    engine = FusionEngine.load(default_llm_path, dtype="float32")
    for ids, ctx, key, (k, v, header) in zip(chunks, contexts, rec.chunk_keys, blobs, strict=True):
        assert key == kvblob.chunk_key(engine.fingerprint, "float32", ids, ctx) == header.key
        assert header.context_hash == kvblob.context_hash(ctx)
        want = engine.precompute_after(ctx, ids)
        torch.testing.assert_close(k, want.k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v, want.v, atol=1e-4, rtol=1e-4)
    assert rec.chunk_keys[1] != kvblob.chunk_key(engine.fingerprint, "float32", chunks[1])  # not the alone cache

    # The mode changed: what is stored still serves as it is, and a new document gets its new mode.
    server = ServerProcess(data, tmp_path / "neighbours.log", KVFUSE_STORE__PRECOMPUTE_CONTEXT="neighbours",
                           **ENV).start()
    try:
        with make_client(server) as c:
            _ask(c, "todo")
            assert metric(c, "kvfuse_kv_fingerprint_misses_total") == 0
            assert metric(c, "kvfuse_rebuilt_chunks_total") == 0
            ingest(c, [{"id": "short", "text": SHORT}])
            _ask(c, "short")
    finally:
        server.stop()
    short, _ = _stored(data, "short")
    assert len(short.chunk_keys) == 1
    # Its one neighbour: the chunk of `todo` closest to it by the embedder's cosine.
    embedder = Embedder(default_embedder_path)
    texts = [c.text for c in chunker.chunk(text)]
    sims = embedder.embed(texts) @ embedder.embed([SHORT])[0]
    nearest = chunks[int(sims.argmax())]
    assert short.chunk_contexts == [kvblob.context_hash(nearest[-BUDGET:])]

    # The default, `document_or_neighbours`: a one-chunk document takes its nearest chunk; a longer one
    # each chunk's own text before it, but its first chunk, which has none, its nearest.
    more = essays3["pow"][:1200]
    server = ServerProcess(data, tmp_path / "default.log", **ENV).start()
    try:
        with make_client(server) as c:
            ingest(c, [{"id": "again", "text": SHORT2}, {"id": "more", "text": more}])
            _ask(c, "again")
    finally:
        server.stop()
    again, _ = _stored(data, "again")
    cands = [*chunks, chunker.chunk(SHORT)[0].token_ids]
    sims = embedder.embed([*texts, SHORT]) @ embedder.embed([SHORT2])[0]
    assert again.chunk_contexts == [kvblob.context_hash(cands[int(sims.argmax())][-BUDGET:])]
    rec, _ = _stored(data, "more")
    own = document_contexts([c.token_ids for c in chunker.chunk(more)], BUDGET)
    assert len(own) >= 2 and rec.chunk_contexts[1:] == [kvblob.context_hash(ctx) for ctx in own[1:]]
    assert rec.chunk_contexts[0] != ""


@pytest.mark.parametrize("mode", ["none", "document", "neighbours", "prefix", "sink"])
def test_every_mode_ingests_and_answers(tmp_path: Path, essays3: dict[str, str], mode: str,
                                        default_llm_path: str) -> None:
    from kvfuse.fusion import FusionEngine

    data = tmp_path / "data"
    server = ServerProcess(data, tmp_path / "server.log", KVFUSE_STORE__PRECOMPUTE_CONTEXT=mode, **ENV).start()
    try:
        with make_client(server) as c:
            # `nft` one chunk: only `pow` (two) is read back
            docs = ingest(c, [{"id": "pow", "text": essays3["pow"][:1200]}, {"id": "nft", "text": essays3["nft"][:300]}])
            assert [d["status"] for d in docs["documents"]] == ["ready", "ready"], docs
            _ask(c, "pow")
            resp = c.post("/v1/query", json={"query": "What is this essay about?"})
            assert resp.status_code == 200 and resp.json()["sources"], resp.text
    finally:
        server.stop()
    rec, blobs = _stored(data, "pow")
    assert len(rec.chunk_keys) >= 2
    if mode == "none":
        assert rec.chunk_contexts == [] and all(h.context_hash == "" for _, _, h in blobs)
    elif mode == "prefix":
        from kvfuse.retriever import Chunker

        engine = FusionEngine.load(default_llm_path, dtype="float32")
        prefix = engine.prompt_parts("", ModelSettings().system_prompt)[0][-BUDGET:]
        assert rec.chunk_contexts == [kvblob.context_hash(prefix)] * len(rec.chunk_keys)
        ids = [c.token_ids for c in Chunker.from_pretrained(default_llm_path, CHUNK_TOKENS).chunk(essays3["pow"][:1200])]
        assert rec.chunk_tokens == [len(t) for t in ids]
        k, v, header = blobs[1]
        want = engine.precompute_after(prefix, ids[1])
        assert header.context_hash == rec.chunk_contexts[1]
        torch.testing.assert_close(k, want.k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v, want.v, atol=1e-4, rtol=1e-4)
    elif mode == "sink":  # one BOS before every chunk, whatever the system prompt
        bos = FusionEngine.load(default_llm_path, dtype="float32").tokenizer.bos_token_id
        assert rec.chunk_contexts == [kvblob.context_hash([bos])] * len(rec.chunk_keys)
    else:
        assert any(rec.chunk_contexts), rec.chunk_contexts

