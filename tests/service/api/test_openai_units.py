"""The OpenAI endpoints' request rules without a server: OpenAI's bounds where /v1/query keeps its own,
refusals that name the field, embeddings inputs (token ids decoded with cl100k_base, the limits), and the
unknown-path answer listing the endpoints. The live endpoints: test_rag_http.py, "OpenAI conventions"."""

from __future__ import annotations

import pytest

from kvfuse.config import Settings
from kvfuse.service.api.openai_conventions import (
    check_content_parts,
    check_logit_bias,
    check_sampling,
    embedder_names,
)
from kvfuse.service.api.openai_embeddings import input_texts, token_encoding
from kvfuse.service.api.openai_schemas import ChatIn, CompletionIn, EmbeddingsIn
from kvfuse.service.api.openai_structured import response_grammar
from kvfuse.service.api.schemas import QueryIn, validate
from kvfuse.service.errors import APIError

USER = [{"role": "user", "content": "q"}]


def _refused(fn, *args) -> APIError:
    with pytest.raises(APIError) as err:
        fn(*args)
    return err.value


@pytest.mark.parametrize(("field", "value"), [("temperature", 2.5), ("top_p", 1.5), ("presence_penalty", 3),
                                              ("frequency_penalty", -2.5), ("n", 0)])
def test_openai_bounds_refuse_what_openai_refuses_and_query_keeps_its_own(field: str, value: float) -> None:
    for model, body in ((ChatIn, {"model": "m", "messages": USER}), (CompletionIn, {"model": "m", "prompt": "q"})):
        err = _refused(validate, model, {**body, field: value})
        assert err.param == field, (model, err.message)
    if field == "temperature":  # /v1/query's own bound (5) still admits it
        assert validate(QueryIn, {"query": "q", "temperature": value}).temperature == value


def _chat(**extra) -> ChatIn:
    return validate(ChatIn, {"model": "m", "messages": USER, **extra})


@pytest.mark.parametrize(("extra", "code", "param"), [
    ({"stream_options": {"include_usage": True}}, "invalid_value", "stream_options"),
    ({"n": 9}, "invalid_value", "n"),
    ({"logit_bias": {"x": 1}}, "invalid_value", "logit_bias"),
    ({"logit_bias": {"504": -101}}, "invalid_value", "logit_bias"),
    ({"use_retrieval": False, "document_ids": ["a"]}, "invalid_value", "use_retrieval"),
])
def test_sampling_refusals_name_the_field(extra: dict, code: str, param: str) -> None:
    err = _refused(check_sampling, _chat(**extra), 8)
    assert (err.status, err.code, err.param) == (400, code, param), err.message


def test_penalties_and_biases_within_openais_bounds_pass_with_token_ids_of_the_model() -> None:
    body = _chat(presence_penalty=0.5, frequency_penalty=-2, logit_bias={"504": -100, "7": 100}, stream=True,
                 stream_options={"include_usage": True})
    check_sampling(body, 8)
    assert check_logit_bias(body, 49152) == {504: -100.0, 7: 100.0}
    err = _refused(check_logit_bias, _chat(logit_bias={"49152": 1}), 49152)  # past the model's vocabulary
    assert (err.status, err.code, err.param) == (400, "invalid_value", "logit_bias")


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                  {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
                                  {"type": "file", "file": {"file_id": "f"}}])
def test_content_parts_the_model_cannot_read_are_refused_by_their_place(part: dict) -> None:
    body = _chat(messages=[{"role": "system", "content": "s"},
                           {"role": "user", "content": [{"type": "text", "text": "look"}, part]}])
    err = _refused(check_content_parts, body)
    assert (err.status, err.code, err.param) == (400, "unsupported_content", "messages[1].content[1].type")
    assert part["type"] in err.message
    ok = _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    check_content_parts(ok)
    assert ok.messages[0].text() == "ab"


def _texts(settings: Settings, raw: object) -> list[str]:
    return input_texts(validate(EmbeddingsIn, {"model": "m", "input": raw}), settings)


def test_embedding_inputs_are_strings_or_cl100k_token_ids() -> None:
    s = Settings()
    enc = token_encoding()
    text = "The tide tables of the northern harbour"
    ids = enc.encode(text)
    assert enc.encode("Hello world") == [9906, 1917]  # cl100k_base's own ids: the encoding of OpenAI's models
    assert _texts(s, text) == [text]
    assert _texts(s, [text, "b"]) == [text, "b"]
    assert _texts(s, ids) == [text]  # one text as token ids
    assert _texts(s, [ids, enc.encode("b")]) == [text, "b"]  # LangChain's batches


@pytest.mark.parametrize(("raw", "status", "code"), [
    ([], 400, "invalid_value"), ([""], 400, "invalid_value"), ([[]], 400, "invalid_value"),
    ([[10**7]], 400, "invalid_value"), ([[100261]], 400, "invalid_value"),  # past the vocabulary; a gap in it
    (["x"] * 5, 413, "batch_too_large"), (["x" * 40, "y" * 70], 413, "input_too_large"),
])
def test_embedding_inputs_out_of_bounds_are_refused(raw: object, status: int, code: str) -> None:
    s = Settings(server={"embeddings_max_inputs": 4, "embeddings_max_chars": 100})
    err = _refused(_texts, s, raw)
    assert (err.status, err.code, err.param) == (status, code, "input"), err.message
    if status == 413:
        assert "server.embeddings_max_" in err.message


def test_a_langchain_size_batch_is_within_the_default_limit() -> None:
    assert len(_texts(Settings(), ["chunk text"] * 1000)) == 1000


def test_embedder_names_are_its_full_id_then_its_short_name() -> None:
    assert embedder_names(Settings()) == ["sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2"]
    assert embedder_names(Settings(model={"embedder": "/models/bge-small"})) == ["/models/bge-small", "bge-small"]


def test_an_unknown_v1_path_lists_the_endpoints_served() -> None:
    from starlette.testclient import TestClient

    from kvfuse.service.api.app import create_app

    client = TestClient(create_app(Settings()))  # not entered: no lifespan, nothing loads
    body = client.post("/v1/completion", json={}).json()["error"]
    assert body["code"] == "not_found" and body["message"].startswith("Invalid URL (POST /v1/completion)")
    for endpoint in ("POST /v1/completions", "POST /v1/embeddings", "POST /v1/chat/completions",
                     "GET /v1/models/{model_id}", "POST /v1/query"):
        assert endpoint in body["message"]
    assert client.get("/nothing").json()["error"]["message"] == "Not Found"  # outside /v1/: as before


@pytest.mark.parametrize(("fmt", "code", "param", "words"), [
    ({"type": "yaml"}, "invalid_value", "response_format.type", "'yaml'"),
    ("json", "invalid_value", "response_format.type", "'json'"),
    ({"type": "json_schema"}, "invalid_value", "response_format.json_schema", "json_schema object"),
    ({"type": "json_schema", "json_schema": {"name": "", "schema": {}}}, "invalid_value",
     "response_format.json_schema.name", "''"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, "invalid_value",
     "response_format.json_schema.schema", "schema object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": "one"}}},
     "invalid_json_schema", "response_format.json_schema.schema", "minimum"),
])
def test_a_response_format_that_cannot_be_followed_is_refused_naming_its_field(fmt, code, param, words) -> None:
    err = _refused(response_grammar, fmt)
    assert (err.status, err.code, err.param) == (400, code, param) and words in err.message


def test_response_formats_give_the_grammar_of_their_json_or_none_for_text() -> None:
    """text: no grammar; json_object: any object; json_schema: the schema itself (strict or not), as
    llguidance's serialised grammar naming it."""
    import json

    assert response_grammar(None) is None and response_grammar({"type": "text"}) is None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for strict in (True, False):
        g = json.loads(response_grammar({"type": "json_schema",
                                         "json_schema": {"name": "n", "schema": schema, "strict": strict}}))
        assert g["grammars"][0]["json_schema"]["properties"] == schema["properties"]
    g = json.loads(response_grammar({"type": "json_object"}))
    assert g["grammars"][0]["json_schema"]["type"] == "object"


def test_response_format_on_the_legacy_completions_is_refused_by_name() -> None:
    from kvfuse.service.api.openai_completions import _prompt

    body = validate(CompletionIn, {"model": "kvfuse", "prompt": "q", "response_format": {"type": "json_object"}})
    err = _refused(_prompt, body)
    assert (err.status, err.code, err.param) == (400, "unsupported_parameter", "response_format")
    assert _prompt(validate(CompletionIn, {"model": "kvfuse", "prompt": "q"})) == "q"
