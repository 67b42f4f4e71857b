"""What RAG users reach for first, over real HTTP on a real server (worker, default model, LMDB, FAISS,
BM25): files (PDF, DOCX, HTML, Markdown written by the tests), /v1/search, citations and chunk listing,
operator filters and delete by filter, OpenAI conventions through the official client, conversations and
keep-alive pings. One server for the module; the tests run in file order (deletions come last)."""

from __future__ import annotations

import json
import threading
import time

import file_fixtures as ff
import httpx
import numpy as np
import pytest
from service_helpers import API_KEY, Holder, make_client, serving

from kvfuse.service.api.responses import ChunkList, QueryAnswer, SearchResults

pytestmark = pytest.mark.slow

SERVER_ENV = {
    "KVFUSE_SERVER__API_KEYS": API_KEY,
    "KVFUSE_RETRIEVER__CHUNK_TOKENS": "64",
    "KVFUSE_STORE__PRECOMPUTE_CONTEXT": "none",  # each chunk alone: the fastest ingestion
    "KVFUSE_RETRIEVER__TOP_K": "2",
    "KVFUSE_MODEL__MAX_CONTEXT_TOKENS": "1024",
    "KVFUSE_GENERATION__MAX_TOKENS": "4",
    "KVFUSE_GENERATION__HISTORY_MAX_TOKENS": "60",
    "KVFUSE_SERVER__SSE_PING_S": "0.02",
    "KVFUSE_SERVER__MAX_BODY_BYTES": "400000",
    "KVFUSE_SERVER__KV_BUDGET_TOKENS": "4096",  # n choices that cannot fit together are refused (test_n_choices_*)
}
NOTES = [
    {"id": "n1999", "text": "The zanzibarite crystal was found in a quarry near the coast. Miners kept it in a box.",
     "metadata": {"year": 1999, "kind": "mineral"}},
    {"id": "n2005", "text": "Orchard keepers prune apple trees in late winter, before the buds open.",
     "metadata": {"year": 2005, "kind": "garden"}},
    {"id": "n2020", "text": "The tide tables of the northern harbour were first printed by the lighthouse keeper.",
     "metadata": {"year": 2020, "kind": "harbour"}},
]
QUESTION = "What did the palliative care nurse Bronnie Ware make a list of?"  # in essay "todo"
EMBEDDER = "sentence-transformers/all-MiniLM-L6-v2"


def _setup(c: httpx.Client) -> None:
    resp = c.post("/v1/documents?wait=true", json={"documents": NOTES, "collection": "notes"})
    assert resp.status_code == 201, resp.text


@pytest.fixture(scope="module")
def holder(tmp_path_factory: pytest.TempPathFactory, essays3: dict[str, str]):
    # two essays: the one the question is about and another to rank below it (a short setup on a busy CPU)
    essays = {name: essays3[name] for name in ("todo", "nft")}
    with serving(tmp_path_factory.mktemp("rag"), SERVER_ENV, essays, _setup) as h:
        yield h


@pytest.fixture
def client(holder: Holder):
    with make_client(holder.server) as c:
        yield c


def _error(resp: httpx.Response, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == code, err
    return err


def _upload(client: httpx.Client, name: str, data: bytes, **form: str) -> httpx.Response:
    return client.post("/v1/documents?wait=true", files={"file": (name, data)}, data=form)


# -- search, citations, chunks -----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["dense", "keyword", "hybrid"])
def test_search_returns_what_query_would_use_with_text_and_metadata(client: httpx.Client, essays3, mode: str) -> None:
    body = {"query": QUESTION, "top_k": 2, "retrieval": {"mode": mode}}
    found = SearchResults.model_validate(client.post("/v1/search", json=body).json())
    answer = QueryAnswer.model_validate(client.post("/v1/query", json={**body, "max_tokens": 1}).json())
    assert [(r.document_id, r.chunk_index) for r in found.results] == \
        [(s.document_id, s.chunk_index) for s in answer.sources]
    assert [r.score for r in found.results] == [s.score for s in answer.sources]
    top = found.results[0]
    assert top.document_id == "todo" and top.metadata == {"topic": "todo"}
    assert top.text and top.text in essays3["todo"] and "Bronnie Ware" in top.text
    assert answer.sources[0].text == top.text and answer.sources[0].metadata == {"topic": "todo"}
    assert found.retrieval.mode == mode and found.retrieval.collections == ["default"]


def test_chunk_listing_tiles_the_document_and_matches_the_citations(client: httpx.Client, essays3) -> None:
    listing = ChunkList.model_validate(client.get("/v1/documents/todo/chunks").json())
    assert "".join(c.text for c in listing.chunks) == essays3["todo"]
    assert [c.chunk_index for c in listing.chunks] == list(range(len(listing.chunks)))
    assert listing.metadata == {"topic": "todo"} and listing.collection == "default"
    doc = client.get("/v1/documents/todo").json()
    assert len(listing.chunks) == doc["chunks"] and sum(c.tokens for c in listing.chunks) == doc["tokens"]
    hit = client.post("/v1/search", json={"query": QUESTION, "top_k": 1}).json()["results"][0]
    assert listing.chunks[hit["chunk_index"]].text == hit["text"]
    _error(client.get("/v1/documents/nope/chunks"), 404, "document_not_found")


# -- filters ----------------------------------------------------------------------------------------------

FILTERS = [
    ({"year": {"$gte": 2005}}, {"n2005", "n2020"}),
    ({"year": {"$lt": 2005}}, {"n1999"}),
    ({"kind": {"$in": ["garden", "harbour"]}}, {"n2005", "n2020"}),
    ({"kind": {"$nin": ["garden", "harbour"]}}, {"n1999"}),
    ({"kind": {"$ne": "garden"}}, {"n1999", "n2020"}),
    ({"$or": [{"year": 1999}, {"kind": "harbour"}]}, {"n1999", "n2020"}),
    ({"$and": [{"year": {"$gt": 1999}}, {"year": {"$lte": 2005}}]}, {"n2005"}),
]


@pytest.mark.parametrize("mode", ["dense", "keyword"])
@pytest.mark.parametrize(("flt", "expected"), FILTERS, ids=[json.dumps(f) for f, _ in FILTERS])
def test_operator_filters_select_the_same_documents_in_every_mode(client: httpx.Client, mode: str, flt: dict,
                                                                   expected: set[str]) -> None:
    # a question sharing a term with every note, so keyword mode can return each of them
    body = {"query": "the keeper found the tide and the quarry and the orchard", "top_k": 10, "filters": flt,
            "retrieval": {"mode": mode, "collections": ["notes"]}}
    resp = client.post("/v1/search", json=body)
    assert resp.status_code == 200, resp.text
    assert {r["document_id"] for r in resp.json()["results"]} == expected


@pytest.mark.parametrize(("flt", "param"), [
    ({"year": {"$gtt": 2000}}, "filters.year"),
    ({"$nor": [{"year": 1999}]}, "filters.$nor"),
    ({"kind": {"$in": "garden"}}, "filters.kind"),
])
def test_a_malformed_filter_is_422_naming_its_place(client: httpx.Client, flt: dict, param: str) -> None:
    for path, body in (("/v1/search", {"query": "apple"}), ("/v1/query", {"query": "apple", "max_tokens": 1})):
        err = _error(client.post(path, json={**body, "filters": flt, "retrieval": {"collections": ["notes"]}}), 422,
                     "invalid_filter")
        assert err["param"] == param


# -- files ------------------------------------------------------------------------------------------------

def test_a_pdf_is_ingested_with_its_pages_as_chunk_metadata(client: httpx.Client) -> None:
    resp = _upload(client, "harbour.pdf", ff.pdf_bytes(), id="harbour", collection="files",
                   metadata=json.dumps({"source": "archive"}))
    assert resp.status_code == 201, resp.text
    doc = client.get("/v1/documents/harbour").json()
    assert doc["metadata"]["filename"] == "harbour.pdf" and doc["metadata"]["content_type"] == "application/pdf"
    assert doc["metadata"]["source"] == "archive" and len(doc["metadata"]["page_starts"]) == len(ff.PAGES)
    chunks = client.get("/v1/documents/harbour/chunks").json()["chunks"]
    text = " ".join(" ".join(c["text"].split()) for c in chunks)
    for page in ff.PAGES:
        assert " ".join(page.split()) in text
    pages = [c["page"] for c in chunks]
    assert pages == sorted(pages) and pages[0] == 1 and pages[-1] == len(ff.PAGES)
    hit = client.post("/v1/search", json={"query": "How many crates did the copper merchants ship to Lisbon?",
                                          "top_k": 1, "retrieval": {"collections": ["files"]}}).json()["results"][0]
    assert hit["document_id"] == "harbour" and hit["page"] == 2 and "4,380" in hit["text"]
    assert "page_starts" not in hit["metadata"] and hit["metadata"]["filename"] == "harbour.pdf"


@pytest.mark.parametrize(("name", "data"), [
    ("orchard.docx", ff.docx_bytes()),
    ("orchard.html", ff.html_text().encode()),
    ("orchard.md", ff.markdown_text().encode()),
])
def test_docx_html_and_markdown_keep_their_sections(client: httpx.Client, name: str, data: bytes) -> None:
    doc_id = name.replace(".", "-")
    resp = _upload(client, name, data, id=doc_id, collection="files")
    assert resp.status_code == 201, resp.text
    chunks = client.get(f"/v1/documents/{doc_id}/chunks").json()["chunks"]
    text = "".join(c["text"] for c in chunks)
    assert "tracking" not in text and "color: red" not in text  # HTML's script and style are not text
    for title, body in ff.SECTIONS:
        assert title in text and " ".join(body.split()) in " ".join(text.split())
    harvest = [c for c in chunks if "9,000 kilograms" in c["text"]]
    assert harvest and harvest[0]["section"] == "Harvest", chunks


def test_refused_files_store_nothing(client: httpx.Client) -> None:
    before = client.get("/v1/documents?limit=1").json()["total"]
    _error(_upload(client, "sheet.xlsx", b"PK\x03\x04 not a workbook", id="sheet"), 415, "unsupported_media_type")
    _error(_upload(client, "locked.pdf", ff.pdf_bytes(password="secret"), id="locked"), 422, "unparsable_file")
    _error(_upload(client, "broken.pdf", b"%PDF-1.7 truncated", id="broken"), 422, "unparsable_file")
    _error(_upload(client, "blank.pdf", ff.pdf_bytes([" ", " "]), id="blank"), 422, "empty_document")
    _error(_upload(client, "huge.txt", b"word " * 100_000, id="huge"), 413, "body_too_large")
    _error(_upload(client, "x.md", b"# t\n\nfine", id="x", metadata="[1]"), 422, "invalid_value")
    assert client.get("/v1/documents?limit=1").json()["total"] == before
    for doc_id in ("sheet", "locked", "broken", "blank", "huge", "x"):
        _error(client.get(f"/v1/documents/{doc_id}"), 404, "document_not_found")


def test_the_cli_sends_files_as_uploads(holder: Holder, client: httpx.Client, tmp_path) -> None:
    import subprocess
    import sys

    from service_helpers import REPO

    (tmp_path / "orchard-notes.docx").write_bytes(ff.docx_bytes())
    (tmp_path / "harbour-log.pdf").write_bytes(ff.pdf_bytes())
    out = subprocess.run([sys.executable, "-m", "kvfuse.cli", "ingest", str(tmp_path), "--url", holder.server.url,
                          "--api-key", API_KEY, "--collection", "cli-files"], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "2 of 2 documents ingested" in out.stdout
    pdf = client.get("/v1/documents/harbour-log").json()
    assert pdf["collection"] == "cli-files" and len(pdf["metadata"]["page_starts"]) == len(ff.PAGES)
    chunks = client.get("/v1/documents/orchard-notes/chunks").json()["chunks"]
    assert {c["section"] for c in chunks} == {t for t, _ in ff.SECTIONS}


# -- OpenAI conventions ----------------------------------------------------------------------------------

def _openai(holder: Holder):
    from openai import OpenAI

    return OpenAI(base_url=holder.server.url + "/v1", api_key=API_KEY, timeout=180, max_retries=0)


def test_the_full_model_id_is_served_and_listed_first(holder: Holder) -> None:
    import openai

    oa = _openai(holder)
    names = [m.id for m in oa.models.list()]
    assert names == ["HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct", "kvfuse", EMBEDDER,
                     "all-MiniLM-L6-v2"]
    for name in names:  # each listed id is a model the client can look up
        assert oa.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError) as err:
        oa.models.retrieve("gpt-4o")
    assert err.value.code == "model_not_found" and EMBEDDER in err.value.message
    for name in names[:3]:
        resp = oa.chat.completions.create(model=name, messages=[{"role": "user", "content": QUESTION}], max_tokens=1)
        assert resp.model == names[0] and resp.choices[0].finish_reason in ("stop", "length")


def test_invalid_parameters_are_bad_requests_for_the_official_client(holder: Holder) -> None:
    import openai

    oa = _openai(holder)
    user = [{"role": "user", "content": QUESTION}]
    cases = [
        ({"n": 9}, "invalid_value", "n"),  # over server.max_choices
        ({"temperature": 9}, "invalid_value", "temperature"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "unsupported_parameter",
         "tools"),
        ({"response_format": {"type": "xml"}}, "invalid_value", "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "invalid_value", "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}}, "invalid_value",
         "response_format.json_schema.name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "thing"}}}},
         "invalid_json_schema", "response_format.json_schema.schema"),
        ({"top_logprobs": 2}, "invalid_value", "top_logprobs"),
        ({"max_tokens": 1024}, "context_length_exceeded", "messages"),
        ({"messages": [{"role": "user", "content": "word " * 3000}]}, "context_length_exceeded", "messages"),
    ]
    for extra, code, param in cases:
        kwargs = {"model": "kvfuse", "messages": user, "max_tokens": 2, **extra}
        with pytest.raises(openai.BadRequestError) as err:
            oa.chat.completions.create(**kwargs)
        assert err.value.status_code == 400 and err.value.code == code and err.value.param == param, extra
    # text is what it answers in anyway: accepted
    ok = oa.chat.completions.create(model="kvfuse", messages=user, max_tokens=1, response_format={"type": "text"})
    assert ok.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError):
        oa.chat.completions.create(model="gpt-9", messages=user, max_tokens=1)


def test_structured_answers_parse_and_validate_through_the_clients_response_format(holder: Holder) -> None:
    """response_format through the official client: a pydantic model (`parse`, as LangChain's
    with_structured_output sends it: a strict json_schema), json_object, and a bad schema's 400 naming it."""
    import openai
    import pydantic

    class Finding(pydantic.BaseModel):
        topic: str = pydantic.Field(max_length=40)
        items: list[str] = pydantic.Field(max_length=3)
        certain: bool

    oa = _openai(holder)
    user = [{"role": "user", "content": QUESTION + " Answer in JSON."}]
    for stream in (False, True):
        if stream:
            with oa.chat.completions.stream(model="kvfuse", messages=user, max_tokens=96, response_format=Finding) as s:
                done = s.get_final_completion()
        else:
            done = oa.chat.completions.parse(model="kvfuse", messages=user, max_tokens=96, response_format=Finding)
        found = done.choices[0].message.parsed
        assert done.choices[0].finish_reason == "stop" and isinstance(found, Finding), done.choices[0].message.content
        assert len(found.topic) <= 40 and len(found.items) <= 3
    copy = [{"role": "user", "content": 'Reply with the JSON object {"answer": "a list"} and nothing else.'}]
    resp = oa.chat.completions.create(model="kvfuse", messages=copy, max_tokens=48,
                                      response_format={"type": "json_object"})
    assert resp.choices[0].finish_reason == "stop", resp.choices[0].message.content
    assert isinstance(json.loads(resp.choices[0].message.content), dict)
    bad = {"type": "json_schema", "json_schema": {"name": "f", "strict": True,
                                                  "schema": {"type": "string", "pattern": "(("}}}
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model="kvfuse", messages=user, max_tokens=8, response_format=bad)
    assert err.value.code == "invalid_json_schema" and "unclosed group" in err.value.message


def test_the_official_client_reaches_every_endpoint(holder: Holder) -> None:
    """docs/usage.md, "The official openai client", line by line: models list and retrieve, chat (JSON and
    streamed: the same greedy text, usage last), completions (chat's answer to the same question), embeddings
    (the embedder's unit vectors, one per input), response_format, and n > 1 (greedy: n copies of the
    answer), with an n over server.max_choices refused by name."""
    import openai

    oa = _openai(holder)
    ids = [m.id for m in oa.models.list().data]
    assert [oa.models.retrieve(i).id for i in ids] == ids and "kvfuse" in ids
    user = [{"role": "user", "content": QUESTION}]
    chat = oa.chat.completions.create(model="kvfuse", messages=user, max_tokens=6)
    text = chat.choices[0].message.content
    assert text.strip() and chat.choices[0].index == 0 and chat.usage.completion_tokens <= 6
    chunks = list(oa.chat.completions.create(model="kvfuse", messages=user, max_tokens=6, stream=True,
                                             stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    done = oa.completions.create(model="kvfuse", prompt=QUESTION, max_tokens=6)
    assert done.choices[0].text == text
    emb = oa.embeddings.create(model=EMBEDDER, input=["a chunk", "another chunk"])
    vectors = np.array([d.embedding for d in emb.data])
    assert vectors.shape == (2, 384) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-4)
    schema = {"type": "object", "properties": {"who": {"type": "string", "maxLength": 30}}, "required": ["who"],
              "additionalProperties": False}
    shaped = oa.chat.completions.create(model="kvfuse", messages=user, max_tokens=32, response_format={
        "type": "json_schema", "json_schema": {"name": "who", "schema": schema, "strict": True}})
    value = json.loads(shaped.choices[0].message.content)
    assert set(value) == {"who"} and isinstance(value["who"], str) and len(value["who"]) <= 30
    two = oa.chat.completions.create(model="kvfuse", messages=user, max_tokens=6, n=2)
    assert [(c.index, c.message.content) for c in two.choices] == [(0, text), (1, text)]
    assert two.usage.completion_tokens == 2 * chat.usage.completion_tokens
    assert [c.text for c in oa.completions.create(model="kvfuse", prompt=QUESTION, max_tokens=6, n=2).choices] == \
        [text, text]
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model="kvfuse", messages=user, max_tokens=2, n=9)
    assert err.value.param == "n"


def _streamed(chunks) -> tuple[dict[int, str], dict[int, str], dict[int, list], object]:
    """Per choice index: the text, the finish reason and the logprob tokens a stream carried; its usage."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    logprobs: dict[int, list] = {}
    usage = None
    for chunk in chunks:
        assert len(chunk.choices) <= 1  # OpenAI's shape: each chunk carries one choice
        usage = chunk.usage or usage
        for c in chunk.choices:
            delta = getattr(c, "delta", None)
            texts[c.index] = texts.get(c.index, "") + ((delta.content or "") if delta is not None else c.text)
            finish[c.index] = c.finish_reason or finish.get(c.index)
            content = getattr(c.logprobs, "content", None) or []
            logprobs.setdefault(c.index, []).extend(t.token for t in content)
    return texts, finish, logprobs, usage


def test_n_choices_are_each_a_solo_answer_streamed_or_not(holder: Holder) -> None:
    """n = 3 sampled with a seed: choice i is the n = 1 answer with seed + i (docs/usage.md), the choices
    differ, each carries its own logprobs and finish reason; streamed, the per-choice deltas reassemble to
    the same choices; usage counts the prompt once and the completion tokens of every choice."""
    oa = _openai(holder)
    kw = {"model": "kvfuse", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8,
          "temperature": 1.0, "seed": 21, "logprobs": True}
    many = oa.chat.completions.create(**kw, n=3)
    solo = [oa.chat.completions.create(**{**kw, "seed": 21 + i}) for i in range(3)]
    assert [c.index for c in many.choices] == [0, 1, 2]
    texts = [c.message.content for c in many.choices]
    assert texts == [s.choices[0].message.content for s in solo] and len(set(texts)) > 1
    assert [c.finish_reason for c in many.choices] == [s.choices[0].finish_reason for s in solo]
    for c in many.choices:
        assert "".join(t.token for t in c.logprobs.content) == c.message.content
    assert many.usage.prompt_tokens == solo[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in solo)
    streamed, finish, logprobs, usage = _streamed(oa.chat.completions.create(
        **kw, n=3, stream=True, stream_options={"include_usage": True}))
    assert streamed == dict(enumerate(texts))
    assert finish == {c.index: c.finish_reason for c in many.choices}
    assert logprobs == {c.index: [t.token for t in c.logprobs.content] for c in many.choices}
    assert usage.completion_tokens == many.usage.completion_tokens
    legacy = oa.completions.create(model="kvfuse", prompt=QUESTION, max_tokens=8, temperature=1.0, seed=21, n=3)
    assert [c.text for c in legacy.choices] == texts  # the same rows behind the legacy endpoint
    streamed, _, _, _ = _streamed(oa.completions.create(model="kvfuse", prompt=QUESTION, max_tokens=8,
                                                        temperature=1.0, seed=21, n=3, stream=True))
    assert streamed == dict(enumerate(texts))


def test_n_choices_follow_response_format_and_logit_bias_and_fit_together_or_are_refused(
        holder: Holder, default_llm_path: str) -> None:
    import openai

    oa = _openai(holder)
    user = [{"role": "user", "content": QUESTION + " Answer in JSON."}]
    schema = {"type": "object", "properties": {"who": {"type": "string", "maxLength": 30}}, "required": ["who"],
              "additionalProperties": False}
    shaped = oa.chat.completions.create(model="kvfuse", messages=user, max_tokens=32, n=3, temperature=1.0, seed=3,
                                        response_format={"type": "json_schema", "json_schema": {
                                            "name": "who", "schema": schema, "strict": True}})
    for c in shaped.choices:  # every row decodes under the grammar
        value = json.loads(c.message.content)
        assert set(value) == {"who"} and isinstance(value["who"], str) and len(value["who"]) <= 30
    plain = oa.chat.completions.create(model="kvfuse", messages=user, max_tokens=4, logprobs=True)
    first = plain.choices[0].logprobs.content[0].token
    biased = oa.chat.completions.create(model="kvfuse", messages=user, max_tokens=4, n=2, logprobs=True,
                                        logit_bias={str(_token_id(default_llm_path, first)): -100})
    assert all(t.token != first for c in biased.choices for t in c.logprobs.content)
    with pytest.raises(openai.BadRequestError) as err:  # 8 rows of prompt + 600 tokens: over the 4096 budget
        oa.chat.completions.create(model="kvfuse", messages=user, max_tokens=600, n=8)
    assert (err.value.code, err.value.param) == ("choices_exceed_budget", "n") and "n=8" in err.value.message
    alone = oa.chat.completions.create(model="kvfuse", messages=user, max_tokens=2, n=1)  # and nothing was lost
    assert alone.choices[0].message.content is not None


def _token_id(llm_path: str, text: str) -> int:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(llm_path).encode(text, add_special_tokens=False)
    assert len(ids) == 1
    return ids[0]


def test_logprobs_are_the_models_own_and_agree_between_json_and_stream(holder: Holder) -> None:
    import math

    oa = _openai(holder)
    kwargs = {"model": "kvfuse", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4,
              "logprobs": True, "top_logprobs": 3}
    resp = oa.chat.completions.create(**kwargs)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
        # greedy decoding: the chosen token is the most likely one
        assert t.token == t.top_logprobs[0].token and math.isclose(t.logprob, t.top_logprobs[0].logprob)
        assert sum(math.exp(a.logprob) for a in t.top_logprobs) <= 1 + 1e-5
    streamed = []
    for chunk in oa.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            if choice.logprobs and choice.logprobs.content:
                streamed.extend(choice.logprobs.content)
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in content]
    plain = oa.chat.completions.create(**{**kwargs, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_completions_are_chats_answer_to_the_prompt_streamed_or_not(holder: Holder) -> None:
    """The legacy endpoint runs the prompt as chat runs its one user message: same retrieval, same fused
    prompt, same greedy tokens; streamed, the same text with the usage last."""
    oa = _openai(holder)
    chat = oa.chat.completions.create(model="kvfuse", messages=[{"role": "user", "content": QUESTION}], max_tokens=4)
    resp = oa.completions.create(model="kvfuse", prompt=QUESTION, max_tokens=4)
    assert resp.object == "text_completion" and resp.model == chat.model
    assert resp.choices[0].text == chat.choices[0].message.content and resp.choices[0].text.strip()
    assert resp.choices[0].finish_reason == chat.choices[0].finish_reason
    assert resp.usage.prompt_tokens == chat.usage.prompt_tokens and resp.usage.prompt_tokens_details.cached_tokens > 0
    assert [x["document_id"] for x in resp.model_extra["sources"]] == [x["document_id"] for x in chat.model_extra["sources"]]
    text, usage, finish = "", None, None
    for chunk in oa.completions.create(model="kvfuse", prompt=[QUESTION], max_tokens=4, stream=True,
                                       stream_options={"include_usage": True}):
        assert chunk.object == "text_completion"
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            assert choice.index == 0
            text += choice.text
            finish = choice.finish_reason or finish
    assert text == resp.choices[0].text and finish == resp.choices[0].finish_reason
    assert usage.completion_tokens == resp.usage.completion_tokens



def test_a_token_banned_by_logit_bias_never_appears(holder: Holder, default_llm_path: str) -> None:
    """The issue's own case: `logit_bias` {token: -100} used to be ignored. The greedy answer's first token,
    banned, is replaced by the model's next best; logprobs stay the model's own distribution."""
    from transformers import AutoTokenizer

    oa = _openai(holder)
    kwargs = {"model": "kvfuse", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4,
              "logprobs": True, "top_logprobs": 2}
    plain = oa.chat.completions.create(**kwargs).choices[0].logprobs.content
    tokenizer = AutoTokenizer.from_pretrained(default_llm_path)
    banned = tokenizer.encode(plain[0].token, add_special_tokens=False)
    assert tokenizer.decode(banned) == plain[0].token and len(banned) == 1
    biased = oa.chat.completions.create(**kwargs, logit_bias={str(banned[0]): -100}).choices[0].logprobs.content
    assert all(t.token != plain[0].token for t in biased)
    assert biased[0].token == plain[0].top_logprobs[1].token  # the runner-up of the same distribution
    assert [a.token for a in biased[0].top_logprobs] == [a.token for a in plain[0].top_logprobs]


def test_what_openai_refuses_or_this_service_does_not_do_is_a_bad_request_by_name(holder: Holder) -> None:
    import openai

    oa = _openai(holder)
    cases = [  # (endpoint, extra arguments, code, param)
        ("completions", {"echo": True}, "unsupported_parameter", "echo"),
        ("completions", {"suffix": "done."}, "unsupported_parameter", "suffix"),
        ("completions", {"best_of": 2}, "unsupported_parameter", "best_of"),
        ("completions", {"n": 9}, "invalid_value", "n"),
        ("completions", {"prompt": ["one", "two"]}, "invalid_value", "prompt"),
        ("completions", {"temperature": 3}, "invalid_value", "temperature"),
        ("completions", {"stream_options": {"include_usage": True}}, "invalid_value", "stream_options"),
        ("completions", {"logit_bias": {"504": -101}}, "invalid_value", "logit_bias"),
        ("completions", {"logit_bias": {"9999999": 1}}, "invalid_value", "logit_bias"),
        ("completions", {"presence_penalty": 2.5}, "invalid_value", "presence_penalty"),
        ("completions", {"prompt": "word " * 3000}, "context_length_exceeded", "prompt"),
        ("chat", {"temperature": 2.5}, "invalid_value", "temperature"),
        ("chat", {"stream_options": {"include_usage": True}}, "invalid_value", "stream_options"),
        ("chat", {"frequency_penalty": -3}, "invalid_value", "frequency_penalty"),
        ("chat", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]},
         "unsupported_content", "messages[0].content[1].type"),
    ]
    for endpoint, extra, code, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            if endpoint == "completions":
                oa.completions.create(**{"model": "kvfuse", "prompt": QUESTION, "max_tokens": 2, **extra})
            else:
                oa.chat.completions.create(**{"model": "kvfuse", "messages": [{"role": "user", "content": QUESTION}],
                                              "max_tokens": 2, **extra})
        assert err.value.code == code and err.value.param == param, (endpoint, extra, err.value.message)
    with pytest.raises(openai.NotFoundError):
        oa.completions.create(model="gpt-3.5-turbo-instruct", prompt=QUESTION, max_tokens=2)
    with pytest.raises(openai.NotFoundError) as err:  # an unknown path under /v1/ names what is served
        oa.get("/completion", cast_to=object)
    assert "POST /v1/completions" in err.value.message and "POST /v1/embeddings" in err.value.message


def _vectors(resp) -> np.ndarray:
    assert [d.index for d in resp.data] == list(range(len(resp.data)))
    return np.array([d.embedding for d in resp.data], dtype=np.float32)


def test_embeddings_are_the_embedders_for_strings_and_for_cl100k_token_ids(holder: Holder,
                                                                           default_embedder_path: str) -> None:
    import openai
    from transformers import AutoTokenizer

    from kvfuse.service.api.openai_embeddings import token_encoding

    oa = _openai(holder)
    texts = [n["text"] for n in NOTES]
    resp = oa.embeddings.create(model=EMBEDDER, input=texts)  # the client asks for base64 and decodes it
    vecs = _vectors(resp)
    assert resp.model == EMBEDDER and vecs.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    pieces = AutoTokenizer.from_pretrained(default_embedder_path)(texts, add_special_tokens=False)["input_ids"]
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(map(len, pieces))
    floats = oa.embeddings.create(model="all-MiniLM-L6-v2", input=texts, encoding_format="float", dimensions=384)
    np.testing.assert_allclose(_vectors(floats), vecs, atol=1e-6)
    solo = oa.embeddings.create(model=EMBEDDER, input=texts[2])  # a batch = each input alone
    np.testing.assert_allclose(_vectors(solo)[0], vecs[2], atol=1e-5)
    enc = token_encoding()  # LangChain's OpenAIEmbeddings sends cl100k_base token ids
    as_ids = oa.embeddings.create(model=EMBEDDER, input=[enc.encode(t) for t in texts])
    np.testing.assert_allclose(_vectors(as_ids), vecs, atol=1e-5)
    question = _vectors(oa.embeddings.create(model=EMBEDDER, input="Who printed the harbour's tide tables?"))[0]
    assert int(np.argmax(vecs @ question)) == 2
    for kwargs, error, param in [({"dimensions": 100}, openai.BadRequestError, "dimensions"),
                                 ({"input": [[10**7]]}, openai.BadRequestError, "input"),
                                 ({"model": "text-embedding-3-small"}, openai.NotFoundError, "model"),
                                 ({"input": ["x"] * 2049}, openai.APIStatusError, "input")]:
        with pytest.raises(error) as err:
            oa.embeddings.create(**{"model": EMBEDDER, "input": texts, **kwargs})
        assert err.value.param == param, kwargs
    assert err.value.status_code == 413 and err.value.code == "batch_too_large"
    anon = openai.OpenAI(base_url=holder.server.url + "/v1", api_key="not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anon.embeddings.create(model=EMBEDDER, input=texts)


def test_a_search_embeds_its_question_between_the_slices_of_a_thousand_inputs(holder: Holder,
                                                                              client: httpx.Client) -> None:
    """LangChain sends 1,000 inputs at once: embedded slice by slice, so a question waits for one slice."""
    texts = [f"{NOTES[i % 3]['text']} ({i})" for i in range(1000)]
    ended: dict[str, float] = {}

    def batch() -> None:
        with make_client(holder.server) as c:
            resp = c.post("/v1/embeddings", json={"model": EMBEDDER, "input": texts, "encoding_format": "base64"})
        ended["batch"] = time.monotonic()
        ended["status"], ended["count"] = resp.status_code, len(resp.json()["data"])

    worker = threading.Thread(target=batch)
    worker.start()
    time.sleep(0.3)
    found = client.post("/v1/search", json={"query": "Who printed the tide tables?", "top_k": 1,
                                            "retrieval": {"collections": ["notes"]}})
    searched = time.monotonic()
    worker.join()
    assert found.status_code == 200 and found.json()["results"][0]["document_id"] == "n2020"
    assert (ended["status"], ended["count"]) == (200, 1000)
    assert searched < ended["batch"], "the search waited for the whole batch"


def test_sources_in_the_openai_answer_carry_text_and_metadata(holder: Holder) -> None:
    resp = _openai(holder).chat.completions.create(model="kvfuse", messages=[{"role": "user", "content": QUESTION}],
                                                   max_tokens=1)
    top = resp.model_extra["sources"][0]
    assert top["document_id"] == "todo" and "Bronnie Ware" in top["text"] and top["metadata"] == {"topic": "todo"}


# -- conversations ------------------------------------------------------------------------------------------

def test_a_follow_up_retrieves_with_the_conversation_and_old_turns_are_dropped_with_a_warning(
        client: httpx.Client) -> None:
    first = "Tell me about the tide tables of the northern harbour."
    follow_up = "Who made them?"
    turns = [{"role": "user", "content": first}, {"role": "assistant", "content": "They list the tides."},
             {"role": "user", "content": follow_up}]
    body = {"model": "kvfuse", "max_tokens": 1, "top_k": 1, "retrieval": {"collections": ["notes"]}}
    alone = client.post("/v1/chat/completions", json={**body, "messages": turns[-1:]}).json()
    chat = client.post("/v1/chat/completions", json={**body, "messages": turns}).json()

    def searched(query: str) -> str:
        resp = client.post("/v1/search", json={"query": query, "top_k": 1, "retrieval": {"collections": ["notes"]}})
        return resp.json()["results"][0]["document_id"]

    # retrieval searches the user messages and the last one; the last alone without a conversation
    assert chat["sources"][0]["document_id"] == searched(f"{first}\n{follow_up}") == "n2020", chat["sources"]
    assert alone["sources"][0]["document_id"] == searched(follow_up)
    # the earlier turns are in the prompt: more prompt tokens than the follow-up alone
    assert chat["usage"]["prompt_tokens"] > alone["usage"]["prompt_tokens"] and chat["warning"] is None
    long_ago = [{"role": "user", "content": "An old question about something else entirely. " * 6},
                {"role": "assistant", "content": "An old answer about something else entirely. " * 6}]
    trimmed = client.post("/v1/chat/completions", json={**body, "messages": long_ago + turns}).json()
    assert "2 earlier message(s)" in trimmed["warning"]
    assert trimmed["usage"]["prompt_tokens"] == chat["usage"]["prompt_tokens"]  # the same turns were kept


# -- streams -----------------------------------------------------------------------------------------------

def test_a_keep_alive_comment_arrives_while_the_prefill_runs(client: httpx.Client) -> None:
    body = {"query": QUESTION, "stream": True, "top_k": 8, "max_tokens": 2, "fusion": {"method": "vanilla"}}
    lines: list[str] = []
    with client.stream("POST", "/v1/query", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            lines.append(line)
            if line == "data: [DONE]":
                break
    first_token = lines.index("event: token")
    assert ": ping" in lines[lines.index("event: sources"):first_token], lines[:first_token]
    assert lines[-1] == "data: [DONE]"


# -- delete by filter (last: it deletes) --------------------------------------------------------------------

def test_delete_by_filter_dry_runs_first(client: httpx.Client) -> None:
    flt = {"filters": {"year": {"$gte": 2005}}, "collections": ["notes"]}
    dry = client.post("/v1/documents/delete", json=flt).json()
    assert dry == {"dry_run": True, "matched": 2, "deleted": 0, "ids": ["n2005", "n2020"]}
    assert client.get("/v1/documents/n2005").status_code == 200
    done = client.post("/v1/documents/delete", json={**flt, "dry_run": False}).json()
    assert done["deleted"] == 2 and done["ids"] == ["n2005", "n2020"]
    for doc_id in ("n2005", "n2020"):
        _error(client.get(f"/v1/documents/{doc_id}"), 404, "document_not_found")
    left = client.post("/v1/search", json={"query": "apple trees tide tables zanzibarite", "top_k": 5,
                                           "retrieval": {"collections": ["notes"]}}).json()["results"]
    assert {r["document_id"] for r in left} == {"n1999"}
    _error(client.post("/v1/documents/delete", json={"filters": {}}), 422, "invalid_value")
    _error(client.post("/v1/documents/delete", json={"filters": {"year": {"$bad": 1}}}), 422, "invalid_filter")


# -- without a model (last: it restarts the server) ----------------------------------------------------------

def test_search_and_chunk_listing_need_no_worker(holder: Holder, redis_url: str, redis_namespace: str) -> None:
    """The same data dir served by an API with `--workers 0` and no worker anywhere: search and chunk
    listing answer (the API process alone holds the store, the indexes and the embedder)."""
    from fleet_helpers import fleet_env
    from service_helpers import ServerProcess, until

    old = holder.server
    old.stop()
    holder.server = ServerProcess(old.data_dir, old.log_path, KVFUSE_SERVER__WORKERS="0",
                                  **{**SERVER_ENV, **fleet_env(redis_url, redis_namespace)}).start(wait=False)
    with make_client(holder.server) as c:
        def searched() -> httpx.Response | None:
            try:
                resp = c.post("/v1/search", json={"query": QUESTION, "top_k": 1})
            except httpx.TransportError:
                return None
            return resp if resp.status_code != 503 else None

        resp = until(searched, 300, f"the API did not answer /v1/search:\n{holder.server.log_tail()}")
        assert resp.status_code == 200, resp.text
        hit = resp.json()["results"][0]
        assert hit["document_id"] == "todo" and "Bronnie Ware" in hit["text"]
        chunks = c.get("/v1/documents/harbour/chunks").json()["chunks"]
        assert [c["page"] for c in chunks][0] == 1
        assert c.get("/ready").status_code == 503  # no worker: /ready says so, search still answers
