"""API keys that scope, over real HTTP (kvfuse/service/api/auth.py): one server whose keys come from
KVFUSE_API_KEY (full access) and a YAML key file (a key per team, limited to its collection, and a
read-only key), with /metrics public. A team's key can neither list, read, query, chat about nor delete
another collection's documents, and what it may not see answers exactly as what does not exist; a
read-only key reads and queries but cannot write; the fidelity figures, counted over every collection,
are for full-access keys only."""

from __future__ import annotations

import pytest
from service_helpers import API_KEY, Holder, ingest, make_client, serving

pytestmark = pytest.mark.slow

TEAM_A, TEAM_B, READER = "team-a-key-0123456789", "team-b-key-0123456789", "reader-key-0123456789"
NEWCOMER = "newcomer-key-0123456789"  # its collection has no documents yet
KEY_FILE = f"""# key -> what it may do
{TEAM_A}: {{collections: [alpha], access: write}}
{TEAM_B}: {{collections: [beta, gamma]}}
{READER}: {{collections: [alpha], access: read}}
{NEWCOMER}: {{collections: [delta], access: read}}
"""
QUESTION = "What did the palliative care nurse Bronnie Ware make a list of?"


@pytest.fixture(scope="module")
def holder(tmp_path_factory: pytest.TempPathFactory, essays3: dict[str, str]):
    root = tmp_path_factory.mktemp("scoped")
    (root / "keys.yaml").write_text(KEY_FILE)
    env = {"KVFUSE_API_KEY": API_KEY, "KVFUSE_SERVER__API_KEYS_FILE": str(root / "keys.yaml"),
           "KVFUSE_SERVER__METRICS_PUBLIC": "true", "KVFUSE_RETRIEVER__CHUNK_TOKENS": "128",
           "KVFUSE_RETRIEVER__TOP_K": "2", "KVFUSE_MODEL__MAX_CONTEXT_TOKENS": "1024",
           "KVFUSE_GENERATION__MAX_TOKENS": "4"}

    def setup(admin) -> None:
        short = {name: text[:1500] for name, text in essays3.items()}
        ingest(admin, [{"id": "a-todo", "text": short["todo"], "collection": "alpha"},
                       {"id": "b-todo", "text": short["todo"], "collection": "beta"},
                       {"id": "b-pow", "text": short["pow"], "collection": "beta"}])

    with serving(root, env, setup=setup) as h:
        yield h


def _error(resp) -> tuple[int, str, str]:
    body = resp.json()["error"]
    return resp.status_code, body["code"], body["message"]


def test_kvfuse_api_key_is_required_by_the_server(holder: Holder) -> None:
    with make_client(holder.server, key=None) as anon, make_client(holder.server, key="not-a-key") as wrong:
        assert anon.get("/v1/documents").status_code == 401
        assert wrong.get("/v1/documents").status_code == 401
    with make_client(holder.server) as admin:
        assert admin.get("/v1/documents").json()["total"] == 3


def test_metrics_are_public_and_nothing_else_is(holder: Holder) -> None:
    with make_client(holder.server, key=None) as anon, make_client(holder.server, key=TEAM_A) as a:
        resp = anon.get("/metrics")
        assert resp.status_code == 200 and "kvfuse_documents" in resp.text
        assert a.get("/metrics").status_code == 200  # public is public: a scoped key could leave its key off
        assert anon.get("/v1/collections").status_code == 401
        assert anon.post("/v1/query", json={"query": QUESTION}).status_code == 401
        assert anon.get("/v1/fidelity").status_code == 401


def test_the_fidelity_figures_are_for_keys_that_see_every_collection(holder: Holder) -> None:
    # Checks of every collection's queries, kept per method only: the scoped keys are refused them
    # (tests/service/api/test_scoped_figures.py has the same without public metrics).
    with make_client(holder.server) as admin:
        assert admin.get("/v1/fidelity").status_code == 200
    for key in (TEAM_A, TEAM_B, READER):
        with make_client(holder.server, key=key) as c:
            assert _error(c.get("/v1/fidelity"))[:2] == (403, "collection_forbidden")


def test_a_scoped_key_lists_only_its_collections(holder: Holder) -> None:
    with make_client(holder.server, key=TEAM_A) as a, make_client(holder.server, key=TEAM_B) as b:
        assert [d["id"] for d in a.get("/v1/documents").json()["documents"]] == ["a-todo"]
        assert a.get("/v1/documents").json()["total"] == 1
        page = b.get("/v1/documents", params={"limit": 1, "offset": 1}).json()
        assert page["total"] == 2 and [d["id"] for d in page["documents"]] == ["b-pow"]  # creation order
        assert [c["name"] for c in a.get("/v1/collections").json()["collections"]] == ["alpha"]
        assert [c["name"] for c in b.get("/v1/collections").json()["collections"]] == ["beta"]
        hidden, absent = a.get("/v1/documents?collection=beta"), a.get("/v1/documents?collection=nosuch")
        assert _error(hidden)[:2] == _error(absent)[:2] == (404, "collection_not_found")
        assert _error(hidden)[2].replace("beta", "X") == _error(absent)[2].replace("nosuch", "X")


def test_a_scoped_key_cannot_read_another_collections_document_or_job(holder: Holder) -> None:
    with make_client(holder.server, key=TEAM_A) as a, make_client(holder.server) as admin:
        assert a.get("/v1/documents/a-todo?include_text=true").json()["text"]
        hidden, absent = a.get("/v1/documents/b-todo"), a.get("/v1/documents/no-such")
        assert _error(hidden)[:2] == _error(absent)[:2] == (404, "document_not_found")
        assert _error(hidden)[2].replace("b-todo", "X") == _error(absent)[2].replace("no-such", "X")
        job = admin.post("/v1/documents?wait=true", json={"id": "b-extra", "text": "Beta's extra note.",
                                                          "collection": "beta"}).json()
        assert admin.get(f"/v1/jobs/{job['job_id']}").status_code == 200
        assert _error(a.get(f"/v1/jobs/{job['job_id']}"))[:2] == (404, "job_not_found")
        assert admin.delete("/v1/documents/b-extra").status_code == 200


def test_a_scoped_key_cannot_query_or_chat_about_another_collection(holder: Holder) -> None:
    with make_client(holder.server, key=TEAM_A) as a:
        body = a.post("/v1/query", json={"query": QUESTION, "max_tokens": 2}).json()
        assert body["sources"] and {s["document_id"] for s in body["sources"]} == {"a-todo"}
        named = a.post("/v1/query", json={"query": QUESTION, "retrieval": {"collections": ["beta"]}})
        status, code, message = _error(named)
        assert (status, code) == (404, "collection_not_found")
        assert message.endswith("collections with documents: alpha")  # not beta's, though it has documents
        by_id = a.post("/v1/query", json={"query": QUESTION, "document_ids": ["b-todo"]})
        assert _error(by_id)[:2] == (404, "document_not_found")
        chat = {"model": "kvfuse", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2}
        assert _error(a.post("/v1/chat/completions", json={**chat, "document_ids": ["b-pow"]}))[:2] == (
            404, "document_not_found")
        assert _error(a.post("/v1/chat/completions", json={**chat, "retrieval": {"collections": ["beta"]}}))[:2] == (
            404, "collection_not_found")
        answer = a.post("/v1/chat/completions", json=chat).json()
        assert {s["document_id"] for s in answer["sources"]} == {"a-todo"}


def test_a_scoped_key_cannot_delete_or_overwrite_another_collections_documents(holder: Holder) -> None:
    with make_client(holder.server, key=TEAM_A) as a, make_client(holder.server) as admin:
        assert _error(a.delete("/v1/documents/b-todo"))[:2] == (404, "document_not_found")
        assert _error(a.delete("/v1/documents?collection=beta"))[:2] == (404, "collection_not_found")
        assert _error(a.post("/v1/documents", json={"text": "into beta", "collection": "beta"}))[:2] == (
            403, "collection_forbidden")
        taken = a.post("/v1/documents", json={"id": "b-todo", "text": "mine now", "collection": "alpha",
                                              "on_conflict": "overwrite"})
        assert _error(taken)[:2] == (409, "id_taken")
        after = admin.get("/v1/documents/b-todo").json()
        assert after["collection"] == "beta" and after["status"] == "ready"
        assert admin.get("/v1/documents?collection=beta").json()["total"] == 2


def test_a_read_only_key_reads_and_queries_but_cannot_write(holder: Holder) -> None:
    with make_client(holder.server, key=READER) as r:
        assert [d["id"] for d in r.get("/v1/documents").json()["documents"]] == ["a-todo"]
        assert r.post("/v1/query", json={"query": QUESTION, "max_tokens": 2}).status_code == 200
        for resp in (r.post("/v1/documents", json={"text": "a note", "collection": "alpha"}),
                     r.delete("/v1/documents/a-todo"), r.delete("/v1/documents?collection=alpha")):
            assert _error(resp)[:2] == (403, "read_only_key")


def test_a_write_key_ingests_and_deletes_in_its_own_collection(holder: Holder) -> None:
    with make_client(holder.server, key=TEAM_A) as a:
        made = a.post("/v1/documents?wait=true", json={"id": "a-note", "text": "Alpha's own note about lists.",
                                                       "collection": "alpha"})
        assert made.status_code == 201, made.text
        assert a.get(f"/v1/jobs/{made.json()['job_id']}").status_code == 200
        assert a.delete("/v1/documents/a-note").json()["deleted"] is True


def test_a_scoped_key_searches_lists_chunks_and_deletes_by_filter_only_in_its_collections(holder: Holder) -> None:
    with make_client(holder.server, key=TEAM_A) as a, make_client(holder.server, key=READER) as r, \
            make_client(holder.server) as admin:
        found = a.post("/v1/search", json={"query": QUESTION, "top_k": 4}).json()["results"]
        assert found and {x["document_id"] for x in found} == {"a-todo"}
        assert _error(a.post("/v1/search", json={"query": QUESTION, "retrieval": {"collections": ["beta"]}}))[:2] == (
            404, "collection_not_found")
        assert a.get("/v1/documents/a-todo/chunks").json()["chunks"]
        hidden, absent = a.get("/v1/documents/b-todo/chunks"), a.get("/v1/documents/no-such/chunks")
        assert _error(hidden)[:2] == _error(absent)[:2] == (404, "document_not_found")
        everything = {"filters": {"x": {"$ne": 1}}}  # no document has x: every one matches
        dry = a.post("/v1/documents/delete", json=everything).json()
        assert dry["dry_run"] is True and dry["ids"] == ["a-todo"]  # beta's documents match nothing for it
        assert _error(r.post("/v1/documents/delete", json=everything))[:2] == (403, "read_only_key")
        assert admin.post("/v1/documents/delete", json=everything).json()["matched"] >= 3


def test_a_key_with_no_documents_embeds_and_completes_a_prompt_that_holds_its_context(holder: Holder) -> None:
    """LlamaIndex's completion mode sends its retrieved context in the prompt: `use_retrieval: false` needs
    no document, where retrieval finds none (404). Embeddings need only a valid key."""
    import openai

    oa = openai.OpenAI(base_url=holder.server.url + "/v1", api_key=NEWCOMER, max_retries=0, timeout=180)
    prompt = "Context: the harbour's tide tables were printed by the lighthouse keeper.\nQ: Who printed them?\nA:"
    with pytest.raises(openai.NotFoundError):
        oa.completions.create(model="kvfuse", prompt=prompt, max_tokens=3)
    resp = oa.completions.create(model="kvfuse", prompt=prompt, max_tokens=3, logprobs=2,
                                 extra_body={"use_retrieval": False})
    choice, lp = resp.choices[0], resp.choices[0].logprobs
    assert resp.model_extra["sources"] == [] and resp.usage.completion_tokens == len(lp.tokens) >= 1
    assert "".join(lp.tokens) == choice.text and choice.text.strip()
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    for token, logprob, best in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(best) == 2 and max(best.values()) == logprob == best[token]  # greedy: the most likely token
    vec = oa.embeddings.create(model="all-MiniLM-L6-v2", input=prompt).data[0].embedding
    assert len(vec) == 384
