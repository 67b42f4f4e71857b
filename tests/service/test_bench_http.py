"""`kvfuse bench fidelity --url` against a real server: documents go in over REST, every method's answer
comes back over REST, and the benchmark's documents are deleted afterwards; `kvfuse bench load --url`
does not send again a document the server already holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from service_helpers import API_KEY, ServerProcess, make_client, metric

from kvfuse.bench.load import ingest_documents
from kvfuse.cli import main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("bench-http")
    srv = ServerProcess(root / "data", root / "server.log", KVFUSE_SERVER__API_KEYS=API_KEY,
                        KVFUSE_MODEL__MAX_CONTEXT_TOKENS="1024",
                        KVFUSE_STORE__PRECOMPUTE_CONTEXT="none").start()  # each chunk alone: the fastest ingestion
    try:
        yield srv
    finally:
        srv.stop()


def test_fidelity_over_http(server: ServerProcess, default_llm_path: str, tmp_path: Path,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfuse.config import get_settings

    monkeypatch.setenv("KVFUSE_MODEL_CACHE_DIR", str(Path(default_llm_path).parent))  # the CLI's tokenizer
    get_settings.cache_clear()
    out = tmp_path / "fidelity-http.json"
    try:
        rc = main(["bench", "fidelity", "--url", server.url, "--api-key", API_KEY, "--task", "needle",
                   "--n", "2", "--docs", "2", "--doc-tokens", "64", "--methods", "vanilla,a3,anchor",
                   "--ratios", "1.0,0.15", "--max-tokens", "12", "--json", str(out)])
    finally:
        get_settings.cache_clear()
    assert rc == 0
    payload = json.loads(out.read_text())
    assert {(r["method"], r["ratio"]) for r in payload["rows"]} >= {("vanilla", 1.0), ("a3", 1.0), ("anchor", 0.15)}
    by_example: dict[str, dict] = {}
    for o in payload["outcomes"]:
        assert o["ttft_s"] > 0 and o["context_tokens"] > 0
        by_example.setdefault(o["example_id"], {})[(o["method"], o["ratio"])] = o
    assert len(by_example) == 2
    for runs in by_example.values():
        # ratio 1.0 recomputes every context token on the server: vanilla's answer, token for token
        vanilla = next(o for (m, _), o in runs.items() if m == "vanilla")
        a3 = runs[("a3", 1.0)]
        assert a3["prediction"] == vanilla["prediction"]
        assert a3["recomputed_tokens"] == a3["context_tokens"]
        assert 0 < runs[("anchor", 0.15)]["recomputed_tokens"] < runs[("anchor", 0.15)]["context_tokens"]
    with make_client(server) as c:  # the benchmark cleaned up after itself
        listing = c.get("/v1/documents").json()
    assert listing["total"] == 0, listing


def test_load_ingestion_reuses_documents_the_server_holds_with_the_same_text(server: ServerProcess,
                                                                              essays: list) -> None:
    ids, tokens, seconds = ingest_documents(server.url, API_KEY, essays, 200, docs=2)
    assert len(ids) == 2 and tokens > 0 and seconds > 0
    with make_client(server) as c:
        computed = metric(c, "kvfuse_precomputed_chunks_total")
        again = ingest_documents(server.url, API_KEY, essays, 200, docs=2)
        assert again == (ids, tokens, None)  # nothing sent again, so no ingestion time to report
        assert metric(c, "kvfuse_precomputed_chunks_total") == computed
        other = ingest_documents(server.url, API_KEY, essays, 300, docs=2)  # other text under the same ids
        assert other[0] == ids and other[1] > tokens and other[2] > 0
        for doc_id in ids:
            assert c.delete(f"/v1/documents/{doc_id}").status_code == 200


def test_retrieval_end_to_end_asks_every_mode_and_vanilla_on_the_same_documents(server: ServerProcess,
                                                                                tmp_path: Path) -> None:
    from kvfuse.bench.retrieval_e2e import COLLECTION, MODES
    from kvfuse.config import get_settings

    out = tmp_path / "e2e.json"
    get_settings.cache_clear()
    try:
        rc = main(["bench", "retriever", "--url", server.url, "--api-key", API_KEY, "--modes-questions", "1",
                   "--top-k", "1", "--max-tokens", "4", "--method", "anchor", "--no-progress", "--json", str(out)])
    finally:
        get_settings.cache_clear()
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["questions"] == 1 and result["passages"] == 10 and result["method"] == "anchor"
    assert [m["mode"] for m in result["modes"]] == list(MODES)
    for mode in MODES:
        (row,) = result["rows"][mode]
        # One chunk of one passage: its whole document (two chunks of a passage) fits the context
        (doc,) = row["documents"]
        assert doc.startswith("mq-") and row["vanilla_answer"] is not None
        assert 0.0 <= row["f1"] <= 1.0 and 0.0 <= row["vanilla_f1"] <= 1.0
        assert row["ttft_ms"] > 0 and row["vanilla_ttft_ms"] > 0 and isinstance(row["same_context"], bool)
    assert out.with_suffix(".md").read_text().count("\n| ") == 1 + len(MODES)  # the header, one row per mode
    with make_client(server) as c:
        held = {x["name"]: x["documents"] for x in c.get("/v1/collections").json()["collections"]}
        assert held[COLLECTION] == 10
        assert c.delete("/v1/documents", params={"collection": COLLECTION}).json()["deleted"] == 10
