"""Retrieval modes, collections and their errors over real HTTP: a real server, worker, model, LMDB, FAISS
and keyword index. One server for the module; the tests run in file order (later ones delete and
restart)."""

from __future__ import annotations

import shutil

import httpx
import pytest
from service_helpers import API_KEY, Holder, ServerProcess, make_client, metric, serving

from kvfuse.service.api.responses import QueryAnswer

pytestmark = pytest.mark.slow

SERVER_ENV = {
    "KVFUSE_SERVER__API_KEYS": API_KEY,
    "KVFUSE_RETRIEVER__CHUNK_TOKENS": "128",
    "KVFUSE_RETRIEVER__TOP_K": "2",
    "KVFUSE_MODEL__MAX_CONTEXT_TOKENS": "1024",
    "KVFUSE_GENERATION__MAX_TOKENS": "2",
}
QUESTION = "What did the palliative care nurse Bronnie Ware make a list of?"  # answered by "todo"
NOTES = [
    {"id": "note-a", "text": "The zanzibarite crystal was found in a quarry near the coast in 1911. "
                             "Miners kept it in a wooden box.", "metadata": {"year": 1911, "kind": "mineral"}},
    {"id": "note-b", "text": "Orchard keepers prune apple trees in late winter, before the buds open.",
     "metadata": {"year": 2020, "kind": "garden"}},
]


def _add_notes(c: httpx.Client) -> None:
    resp = c.post("/v1/documents?wait=true", json={"documents": NOTES, "collection": "notes"})
    assert resp.status_code == 201, resp.text


@pytest.fixture(scope="module")
def holder(tmp_path_factory: pytest.TempPathFactory, essays3: dict[str, str]):
    with serving(tmp_path_factory.mktemp("retrieval"), SERVER_ENV, essays3, _add_notes) as h:
        yield h


@pytest.fixture
def client(holder: Holder):
    with make_client(holder.server) as c:
        yield c


def _query(client: httpx.Client, query: str = QUESTION, **body) -> httpx.Response:
    return client.post("/v1/query", json={"query": query, "max_tokens": 1, **body})


def _error(resp: httpx.Response, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == code, err
    return err


@pytest.mark.parametrize("mode", ["dense", "keyword", "hybrid"])
def test_every_mode_finds_the_essay_and_reports_its_ranks(client: httpx.Client, mode: str) -> None:
    resp = _query(client, retrieval={"mode": mode})
    assert resp.status_code == 200, resp.text
    body = QueryAnswer.model_validate(resp.json())
    assert body.retrieval.mode == mode and body.retrieval.collections == ["default"]
    assert body.sources[0].document_id == "todo"
    dense = [s.dense_rank for s in body.sources]
    keyword = [s.keyword_rank for s in body.sources]
    if mode == "dense":
        assert dense == [1, 2] and keyword == [None, None]
    elif mode == "keyword":
        assert keyword == [1, 2] and dense == [None, None] and body.sources[0].score > body.sources[1].score > 0
    else:  # fused: each chunk carries its place in both lists (or null where it is absent)
        assert body.sources[0].dense_rank is not None and body.sources[0].keyword_rank is not None
        top = body.sources[0]
        assert top.score == pytest.approx(1 / (60 + top.dense_rank) + 1 / (60 + top.keyword_rank), abs=1e-6)
    assert {s.document_id for s in body.sources} <= {"pow", "todo", "nft"}  # never the other collection


def test_the_configured_default_is_hybrid_and_rrf_k_is_per_request(client: httpx.Client) -> None:
    body = _query(client).json()
    assert body["retrieval"] == {"mode": "hybrid", "collections": ["default"]}
    top = _query(client, retrieval={"rrf_k": 1}).json()["sources"][0]
    assert top["score"] == pytest.approx(sum(1 / (1 + r) for r in (top["dense_rank"], top["keyword_rank"]) if r),
                                         abs=1e-6)


def test_a_rare_word_is_found_by_keyword_in_its_collection(client: httpx.Client) -> None:
    scoped = {"collections": ["notes"]}
    resp = _query(client, "Where was zanzibarite found?", retrieval={"mode": "keyword", **scoped}, top_k=4)
    assert resp.status_code == 200, resp.text
    assert [s["document_id"] for s in resp.json()["sources"]] == ["note-a"]  # only chunks sharing a term
    both = _query(client, "zanzibarite palliative nurse", retrieval={"mode": "keyword",
                                                                     "collections": ["notes", "default"]}, top_k=8)
    assert {s["document_id"] for s in both.json()["sources"]} >= {"note-a", "todo"}
    default_only = _query(client, "zanzibarite", retrieval={"mode": "keyword"})
    _error(default_only, 404, "no_documents")  # the word is only in "notes"
    filtered = _query(client, "apple trees quarry", retrieval={"mode": "hybrid", **scoped}, filters={"year": 2020})
    assert {s["document_id"] for s in filtered.json()["sources"]} == {"note-b"}


def test_collections_are_listed_and_documents_listed_by_collection(client: httpx.Client) -> None:
    assert client.get("/v1/collections").json() == {"collections": [{"name": "default", "documents": 3},
                                                                     {"name": "notes", "documents": 2}]}
    page = client.get("/v1/documents", params={"collection": "notes"}).json()
    assert page["total"] == 2 and [d["id"] for d in page["documents"]] == ["note-a", "note-b"]
    assert {d["collection"] for d in page["documents"]} == {"notes"}
    assert client.get("/v1/documents", params={"limit": 1000}).json()["total"] == 5
    assert client.get("/v1/documents/todo").json()["collection"] == "default"


def test_bad_retrieval_input_gets_clear_errors(client: httpx.Client) -> None:
    err = _error(_query(client, retrieval={"mode": "sparse"}), 422, "invalid_value")
    assert err["param"] == "retrieval.mode" and "'dense', 'keyword' or 'hybrid'" in err["message"]
    err = _error(_query(client, retrieval={"collections": ["nope", "notes"]}), 404, "collection_not_found")
    assert err["param"] == "retrieval.collections" and "'nope'" in err["message"] and "notes" in err["message"]
    err = _error(_query(client, retrieval={"collections": ["bad/name"]}), 422, "invalid_value")
    assert err["param"] == "retrieval.collections.0"
    _error(_query(client, retrieval={"collections": []}), 422, "invalid_value")
    err = _error(_query(client, "is it the, or that?", retrieval={"mode": "keyword"}), 422, "empty_keyword_query")
    assert err["param"] == "query" and "dense or hybrid" in err["message"]
    assert _query(client, "is it the, or that?", retrieval={"mode": "hybrid"}).status_code == 200  # dense alone
    err = _error(_query(client, filters={"year": "1911"}, retrieval={"collections": ["notes"]}), 422,
                 "filter_type_mismatch")
    assert err["param"] == "filters.year" and "number" in err["message"] and "string" in err["message"]
    _error(_query(client, retrieval={"rrf_k": 0}), 422, "invalid_value")
    _error(_query(client, retrieval={"mode": "dense", "extra": 1}), 422, "invalid_value")
    _error(client.get("/v1/documents", params={"collection": "nope"}), 404, "collection_not_found")
    _error(client.get("/v1/documents", params={"collection": "a:b"}), 422, "invalid_value")
    _error(client.delete("/v1/documents", params={"collection": "nope"}), 404, "collection_not_found")
    _error(client.delete("/v1/documents"), 422, "invalid_value")  # never "delete everything"
    bad = client.post("/v1/documents", json={"text": "x y z", "collection": "no spaces"})
    _error(bad, 422, "invalid_value")


def test_the_openai_route_takes_the_same_retrieval_object(client: httpx.Client) -> None:
    resp = client.post("/v1/chat/completions", json={
        "model": "kvfuse", "max_tokens": 1, "messages": [{"role": "user", "content": "zanzibarite quarry"}],
        "retrieval": {"mode": "keyword", "collections": ["notes"]}})
    assert resp.status_code == 200, resp.text
    bad = client.post("/v1/chat/completions", json={
        "model": "kvfuse", "messages": [{"role": "user", "content": "hi"}], "retrieval": {"mode": "sparse"}})
    assert bad.status_code == 400, bad.text  # OpenAI's status for an invalid parameter (/v1/query says 422)
    assert bad.json()["error"]["param"].startswith("retrieval")


def test_same_text_in_two_collections_gets_two_ids_and_shares_its_kv(client: httpx.Client) -> None:
    text = "Basalt columns form when thick lava cools slowly and cracks into hexagons."
    a = client.post("/v1/documents?wait=true", json={"text": text, "collection": "basalt-a"}).json()
    computed = metric(client, "kvfuse_precomputed_chunks_total")
    b = client.post("/v1/documents?wait=true", json={"text": text, "collection": "basalt-b"}).json()
    assert a["document_id"].startswith("basalt-a:sha256-")
    assert b["document_id"] == "basalt-b:" + a["document_id"].split(":", 1)[1]
    docs = [client.get(f"/v1/documents/{d}").json() for d in (a["document_id"], b["document_id"])]
    assert [d["collection"] for d in docs] == ["basalt-a", "basalt-b"]
    # Alone in their collections, both copies have the same (no) context: the stored chunk KV was reused.
    assert metric(client, "kvfuse_precomputed_chunks_total") == computed
    # In a collection with other documents its one chunk is cached after their nearest one
    # (store.precompute_context's default): a cache of its own, shaped by that collection only.
    c = client.post("/v1/documents?wait=true", json={"text": text, "collection": "notes"}).json()
    assert metric(client, "kvfuse_precomputed_chunks_total") == computed + 1
    for d in (a, b, c):
        assert client.delete(f"/v1/documents/{d['document_id']}").status_code == 200


def test_overwrite_and_delete_keep_the_keyword_index_in_step(client: httpx.Client) -> None:
    keyword = {"mode": "keyword", "collections": ["notes"]}
    new = {"id": "note-a", "text": "The obsidianite shard was found on a beach.", "collection": "notes",
           "metadata": {"year": 1911}, "on_conflict": "overwrite"}
    assert client.post("/v1/documents?wait=true", json=new).status_code == 201
    _error(_query(client, "zanzibarite quarry", retrieval=keyword), 404, "no_documents")
    assert [s["document_id"] for s in _query(client, "obsidianite", retrieval=keyword).json()["sources"]] == ["note-a"]
    # Moving a document to another collection by overwriting it
    moved = {**new, "collection": "moved"}
    assert client.post("/v1/documents?wait=true", json=moved).status_code == 201
    assert [s["document_id"] for s in _query(client, "obsidianite", retrieval={
        "mode": "keyword", "collections": ["moved"]}).json()["sources"]] == ["note-a"]
    assert client.delete("/v1/documents/note-a").status_code == 200
    _error(_query(client, "obsidianite", retrieval={"mode": "keyword", "collections": ["moved"]}), 404,
           "collection_not_found")


def test_a_collection_is_deleted_whole(client: httpx.Client) -> None:
    resp = client.delete("/v1/documents", params={"collection": "notes"})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"collection": "notes", "deleted": 1, "ids": ["note-b"]}
    _error(_query(client, retrieval={"collections": ["notes"]}), 404, "collection_not_found")
    assert [c["name"] for c in client.get("/v1/collections").json()["collections"]] == ["default"]


def test_a_restart_keeps_the_keyword_index_and_a_lost_one_is_rebuilt(holder: Holder) -> None:
    keyword = {"mode": "keyword"}
    with make_client(holder.server) as c:
        before = _query(c, retrieval=keyword).json()["sources"]
    server = holder.server
    server.stop()
    holder.server = ServerProcess(server.data_dir, server.log_path, **SERVER_ENV).start()
    with make_client(holder.server) as c:
        assert _query(c, retrieval=keyword).json()["sources"] == before
    holder.server.stop()
    shutil.rmtree(server.data_dir / "keyword")  # lost: rebuilt from the stored text at the next start
    (server.data_dir / "keyword").mkdir()
    (server.data_dir / "keyword" / "keyword.json").write_text('{"torn')
    holder.server = ServerProcess(server.data_dir, server.log_path, **SERVER_ENV).start()
    assert "keyword index unusable" in holder.server.log_tail(400)
    with make_client(holder.server) as c:
        after = _query(c, retrieval=keyword).json()["sources"]
    # The same chunks in the same order; the scores differ a little, as the rebuilt index no longer counts
    # the rows that deletes and overwrites had left dead (docs/DESIGN.md, "The keyword index on change").
    assert [(s["document_id"], s["chunk_index"]) for s in after] == [(s["document_id"], s["chunk_index"])
                                                                    for s in before]
