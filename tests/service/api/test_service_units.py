"""Service pieces that need no server: bind policy, API-key checks, SSE framing, error bodies, request
schemas, CLI helpers and argument types."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from service_helpers import REPO

from kvfuse.config import ServerSettings, Settings
from kvfuse.service.api import sse
from kvfuse.service.api.auth import FULL_ACCESS, KeyRing, check_bind, is_loopback
from kvfuse.service.api.openai_schemas import ChatIn
from kvfuse.service.api.schemas import (
    DOC_ID_PATTERN,
    SEED_MAX,
    SEED_MIN,
    DocumentIn,
    QueryIn,
    decode_utf8,
    parse_json,
    validate,
)
from kvfuse.service.cli_client import collect_files, doc_id_for
from kvfuse.service.errors import APIError


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.5"])
def test_loopback_hosts_need_no_key(host: str) -> None:
    assert is_loopback(host)
    check_bind(host, KeyRing({}), ServerSettings())


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "example.com"])
def test_public_hosts_need_a_key_or_an_explicit_allowance(host: str) -> None:
    with pytest.raises(PermissionError, match="api_keys"):
        check_bind(host, KeyRing({}), ServerSettings())
    check_bind(host, KeyRing({"k": FULL_ACCESS}), ServerSettings())
    check_bind(host, KeyRing({}), ServerSettings(allow_unauthenticated_public=True))


def test_serve_refuses_a_public_bind_without_a_key(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "KVFUSE_DATA_DIR": str(tmp_path), "KVFUSE_SERVER__API_KEYS": ""}
    out = subprocess.run([sys.executable, "-m", "kvfuse.cli", "serve", "--host", "0.0.0.0"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "refusing to bind 0.0.0.0" in out.stderr


def test_api_keys_compare_exactly() -> None:
    keys = KeyRing.of(Settings(server=ServerSettings(api_keys=["alpha-key", "beta-key"])))
    assert keys.principal("beta-key") is FULL_ACCESS
    assert keys.principal("beta-ke") is None and keys.principal("beta-key ") is None
    assert keys.principal(None) is None and KeyRing({}).principal("x") is None
    assert ServerSettings(api_keys="a, b,,c").api_keys == ["a", "b", "c"]  # env style: comma separated


def test_sse_events_are_single_line_json() -> None:
    raw = sse.event({"text": "line one\nline two"}, "token")
    assert raw == b'event: token\ndata: {"text":"line one\\nline two"}\n\n'
    assert sse.event({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert sse.DONE == b"data: [DONE]\n\n"


def test_error_body_shape() -> None:
    err = APIError(429, "slow down", code="queue_full", headers={"Retry-After": "1"})
    assert err.body() == {"error": {"message": "slow down", "type": "rate_limit_error", "param": None,
                                    "code": "queue_full"}}


def test_body_parsing_errors() -> None:
    with pytest.raises(APIError) as e:
        decode_utf8(b"\xff")
    assert e.value.status == 400 and e.value.code == "invalid_encoding"
    with pytest.raises(APIError) as e:
        parse_json(b"{")
    assert e.value.status == 400 and e.value.code == "invalid_json"
    with pytest.raises(APIError) as e:
        validate(QueryIn, {"query": "q", "top_k": "3"})  # strict: no string-to-int coercion
    assert e.value.status == 422 and e.value.param == "top_k"
    assert validate(QueryIn, json.loads('{"query": "q", "fusion": {"recompute_ratio": 1}}')).fusion.recompute_ratio == 1


@pytest.mark.parametrize("depth", [5000, 100_000])
def test_deeply_nested_json_is_a_400_not_a_recursion_error(depth: int) -> None:
    raw = b'{"text": "t", "metadata": {"a": ' + b"[" * depth + b"]" * depth + b"}}"
    with pytest.raises(APIError) as e:
        parse_json(raw)
    assert e.value.status == 400 and e.value.code == "invalid_json" and "nested too deeply" in e.value.message


@pytest.mark.parametrize(("model", "raw", "param"), [
    (DocumentIn, b'{"text": "t", "metadata": {"a": NaN}}', "metadata.a"),
    (DocumentIn, b'{"text": "t", "metadata": {"ok": 1.5, "b": -Infinity}}', "metadata.b"),
    (QueryIn, b'{"query": "q", "temperature": NaN}', "temperature"),
    (QueryIn, b'{"query": "q", "fusion": {"recompute_ratio": NaN}}', "fusion.recompute_ratio"),
    (ChatIn, b'{"model": "m", "messages": [{"role": "user", "content": "q"}], "top_p": NaN}', "top_p"),
])
def test_nan_and_infinity_are_refused_naming_the_field(model: type, raw: bytes, param: str) -> None:
    # Python's json reads a bare NaN or Infinity: the schema, not the store, must refuse it.
    with pytest.raises(APIError) as e:
        validate(model, parse_json(raw))
    assert e.value.status == 422 and e.value.param == param and "finite number" in e.value.message
    assert e.value.message.startswith(param + ":")


def test_finite_metadata_numbers_and_every_scalar_type_still_pass() -> None:
    doc = validate(DocumentIn, parse_json(b'{"text": "t", "metadata": {"f": 1.5, "i": 2, "b": true, "s": "x", '
                                          b'"n": null}}'))
    assert doc.metadata == {"f": 1.5, "i": 2, "b": True, "s": "x", "n": None}


def test_the_seed_is_bounded_to_what_the_sampler_accepts() -> None:
    import torch

    for seed in (SEED_MIN, SEED_MAX):  # the bounds are torch's own
        torch.Generator().manual_seed(seed)
        assert validate(QueryIn, {"query": "q", "seed": seed}).seed == seed
    for seed in (SEED_MAX + 1, 2**70, SEED_MIN - 1):
        with pytest.raises(APIError) as e:
            validate(QueryIn, {"query": "q", "seed": seed})
        assert e.value.status == 422 and e.value.param == "seed" and e.value.message.startswith("seed: Input should")


def test_cli_file_collection_and_ids(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a essay.txt").write_text("a")
    (tmp_path / "sub" / "b.md").write_text("b")
    (tmp_path / "sub" / "image.png").write_bytes(b"\x89PNG")
    files = collect_files([tmp_path])
    assert [f.name for f in files] == ["a essay.txt", "b.md"]
    import re

    assert doc_id_for(files[0]) == "a-essay" and re.match(DOC_ID_PATTERN, doc_id_for(Path("/x/(weird) name!.txt")))
    with pytest.raises(FileNotFoundError):
        collect_files([tmp_path / "missing"])


@pytest.mark.parametrize("argv", [
    ["ingest", "docs", "--batch", "0"],
    ["ingest", "docs", "--batch", "-2"],
    ["ingest", "docs", "--timeout", "0"],
    ["query", "q", "--timeout", "-1"],
    ["query", "q", "--top-k", "0"],
    ["query", "q", "--max-tokens", "0"],
    ["query", "q", "--ratio", "1.5"],
    ["query", "q", "--ratio", "nan"],
    ["serve", "--port", "99999"],
    ["serve", "--port", "0"],
    ["serve", "--workers", "-1"],
])
def test_out_of_range_cli_numbers_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    from kvfuse.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[-2]}: must be" in err and repr(argv[-1]) in err


def test_in_range_cli_numbers_pass() -> None:
    from kvfuse.cli import build_parser

    args = build_parser().parse_args(["query", "q", "--top-k", "1", "--max-tokens", "1", "--ratio", "0",
                                      "--timeout", "0.5"])
    assert (args.top_k, args.max_tokens, args.ratio, args.timeout) == (1, 1, 0.0, 0.5)
    assert build_parser().parse_args(["serve", "--port", "65535", "--workers", "0"]).port == 65535


def test_cli_query_sends_the_retrieval_mode_and_collections_it_is_given() -> None:
    from kvfuse.cli import build_parser
    from kvfuse.service.cli_client import query_body

    plain = query_body(build_parser().parse_args(["query", "q"]))
    assert plain == {"query": "q", "stream": True}  # every other option is the server's default
    args = build_parser().parse_args(["query", "q", "--mode", "keyword", "--collection", "notes", "--collection",
                                      "default", "--method", "a3"])
    body = query_body(args)
    assert body["retrieval"] == {"mode": "keyword", "collections": ["notes", "default"]}
    assert body["fusion"] == {"method": "a3"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["query", "q", "--mode", "fuzzy"])
    assert build_parser().parse_args(["ingest", "a.txt", "--collection", "notes"]).collection == "notes"


def test_cli_help_lists_the_service_commands() -> None:
    out = subprocess.run([sys.executable, "-m", "kvfuse.cli", "query", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "--method" in out.stdout and "--doc" in out.stdout


def _refs(node: object) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def test_openapi_documents_the_bodies_read_by_hand() -> None:
    from kvfuse.config import load_settings
    from kvfuse.service.api.app import create_app

    spec = create_app(load_settings()).openapi()
    body = {path: spec["paths"][path]["post"]["requestBody"]["content"]
            for path in ("/v1/query", "/v1/chat/completions", "/v1/documents")}
    assert body["/v1/query"]["application/json"]["schema"] == {"$ref": "#/components/schemas/QueryIn"}
    assert body["/v1/chat/completions"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatIn"}
    assert "text/plain" in body["/v1/documents"]
    schemas = spec["components"]["schemas"]
    assert {"query", "fusion", "top_k"} <= set(schemas["QueryIn"]["properties"])
    assert "recompute_ratio" in json.dumps(schemas["FusionIn"])
    # Every reference in the document resolves to a component.
    missing = {r for r in _refs(spec) if r.removeprefix("#/components/schemas/") not in schemas}
    assert not missing


def test_ingest_retry_policy_bounds_each_passing_cause_and_backs_off() -> None:
    from kvfuse.service.dispatch.job_book import WorkerCrashed, WorkerJobError
    from kvfuse.service.rag.ingest_retry import INDEX_UNAVAILABLE, WORKER_CRASHED, RetryPolicy, cause_of
    from kvfuse.service.wire import protocol as P
    from kvfuse.store.errors import IndexUnavailableError

    policy = RetryPolicy.from_settings(ServerSettings(ingest_retry_attempts=2, ingest_index_attempts=5,
                                                      ingest_retry_backoff_s=0.5, ingest_retry_backoff_max_s=3))
    assert [policy.pause(n) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert not policy.exhausted(WORKER_CRASHED, 1) and policy.exhausted(WORKER_CRASHED, 2)
    assert not policy.exhausted(INDEX_UNAVAILABLE, 4) and policy.exhausted(INDEX_UNAVAILABLE, 5)
    assert cause_of(WorkerCrashed("the worker process died")) == WORKER_CRASHED
    assert cause_of(IndexUnavailableError("connection refused")) == INDEX_UNAVAILABLE
    assert cause_of(WorkerJobError(P.ERR_INDEX_UNAVAILABLE, "connection refused")) == INDEX_UNAVAILABLE
    # The document's own failures are final.
    assert cause_of(WorkerJobError(P.ERR_INTERNAL, "RuntimeError: boom")) is None
    assert cause_of(ValueError("bad text")) is None


def test_keys_come_from_kvfuse_api_key_its_file_a_key_file_and_a_json_object(tmp_path: Path) -> None:
    from kvfuse.service.api.auth import Principal

    (tmp_path / "api_key").write_text("from-a-secret\n")
    (tmp_path / "keys.yaml").write_text("team-a: {collections: [alpha], access: read}\nops: {}\nnull-scope:\n")
    (tmp_path / "keys.json").write_text('{"team-b": {"collections": ["beta"]}}')
    server = ServerSettings(api_keys='{"env-scoped": {"collections": ["gamma"], "access": "read"}}',
                            api_keys_file=str(tmp_path / "keys.yaml"))
    keys = KeyRing.of(Settings(api_key="from-env", api_key_file=str(tmp_path / "api_key"), server=server))
    assert keys.principal("from-env") is FULL_ACCESS and keys.principal("from-a-secret") is FULL_ACCESS
    assert keys.principal("team-a") == Principal(frozenset({"alpha"}), can_write=False)
    assert keys.principal("ops") == keys.principal("null-scope") == FULL_ACCESS
    assert keys.principal("env-scoped") == Principal(frozenset({"gamma"}), can_write=False)
    json_keys = KeyRing.of(Settings(server=ServerSettings(api_keys_file=str(tmp_path / "keys.json"))))
    assert json_keys.principal("team-b") == Principal(frozenset({"beta"}), can_write=True)


@pytest.mark.parametrize(("text", "message"), [
    ("- just\n- a list\n", "must map each key"),
    ("k: {access: admin}\n", "access"),
    ("k: {collections: []}\n", "collections"),
    ("k: {collections: [a], extra: 1}\n", "extra"),
    ("k: [unclosed\n", "not valid JSON or YAML"),
])
def test_a_bad_key_file_is_one_clear_error(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as err:
        KeyRing.of(Settings(server=ServerSettings(api_keys_file=str(path))))
    assert str(err.value).startswith(f"server.api_keys_file {path}")


def test_a_principal_hides_what_it_may_not_see_and_refuses_writes() -> None:
    from kvfuse.service.api.auth import Principal

    reader = Principal(frozenset({"a", "b"}), can_write=False)
    assert reader.sees("a") and not reader.sees("c") and reader.visible(["c", "b", "a"]) == ["b", "a"]
    for check, status, code in ((lambda: reader.check_collection("c"), 404, "collection_not_found"),
                                (lambda: reader.check_document("d", "c"), 404, "document_not_found"),
                                (reader.check_write, 403, "read_only_key"),
                                (lambda: Principal(frozenset({"a"})).check_write("c"), 403, "collection_forbidden")):
        with pytest.raises(APIError) as err:
            check()
        assert (err.value.status, err.value.code) == (status, code)
    reader.check_collection("a")
    FULL_ACCESS.check_write("anything")


def test_serve_exits_with_one_line_on_an_unreadable_key_file(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "KVFUSE_DATA_DIR": str(tmp_path),
           "KVFUSE_SERVER__API_KEYS_FILE": str(tmp_path / "absent.yaml")}
    out = subprocess.run([sys.executable, "-m", "kvfuse.cli", "serve"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert out.stderr.startswith(f"kvfuse serve: server.api_keys_file {tmp_path / 'absent.yaml'}: cannot read it")
