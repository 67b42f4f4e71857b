"""The query log over real HTTP (kvfuse/service/rag/query_log.py; docs/usage.md, "The quality contract"):
one server with `fidelity.query_log` on and room for three entries. REST and OpenAI queries are logged
with what picked their chunks and what answered them, never the answer or the key; only the last three
stay; `DELETE /v1/query-log` empties it and needs a write key that sees every collection; `kvfuse
calibrate --from-log` measures a sample of it, and says so in one line when it is empty or off. A server
with the log off writes none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from service_helpers import API_KEY, MODEL_CACHE, REPO, Holder, ingest, make_client, serving, until

from kvfuse.service.rag.query_log import LOG_FILE, read_log

READER, TEAM = "reader-key-0123456789", "team-key-0123456789"
KEY_FILE = f"""{READER}: {{access: read}}
{TEAM}: {{collections: [default], access: write}}
"""
SIZE = 3
ENV = {"KVFUSE_API_KEY": API_KEY, "KVFUSE_RETRIEVER__CHUNK_TOKENS": "128", "KVFUSE_RETRIEVER__TOP_K": "2",
       "KVFUSE_MODEL__MAX_CONTEXT_TOKENS": "1024", "KVFUSE_GENERATION__MAX_TOKENS": "3",
       "KVFUSE_MODEL__THREADS": "1", "KVFUSE_FIDELITY__QUERY_LOG": "true",
       "KVFUSE_FIDELITY__QUERY_LOG_SIZE": str(SIZE)}
FIELDS = {"at", "question", "collections", "document_ids", "filters", "top_k", "retrieval_mode", "system_prompt",
          "method", "recompute_ratio", "size_bucket"}
QUESTION = "What did the palliative care nurse Bronnie Ware make a list of?"


@pytest.fixture(scope="module")
def holder(tmp_path_factory: pytest.TempPathFactory, essays3: dict[str, str]):
    root = tmp_path_factory.mktemp("query-log")
    (root / "keys.yaml").write_text(KEY_FILE)
    env = {**ENV, "KVFUSE_SERVER__API_KEYS_FILE": str(root / "keys.yaml")}

    def setup(c) -> None:
        ingest(c, [{"id": name, "text": text[:1500], "metadata": {"topic": name}} for name, text in essays3.items()])

    with serving(root, env, setup=setup) as h:
        yield h


def entries(h: Holder) -> list[dict]:
    return read_log(h.server.data_dir / LOG_FILE, SIZE)


def logged(h: Holder, question: str) -> list[dict]:
    """The log once `question` is its last entry (writes follow the answer, on their own thread)."""
    return until(lambda: (e := entries(h)) and e[-1]["question"] == question and e, 60, f"{question!r} logged")


def query(c, question: str, **body) -> dict:
    resp = c.post("/v1/query", json={"query": question, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_rest_and_openai_queries_are_logged_without_the_answer_or_the_key(holder: Holder) -> None:
    with make_client(holder.server) as c:
        assert c.delete("/v1/query-log").status_code == 200
        rest = query(c, QUESTION, filters={"topic": "todo"}, system_prompt="Answer in one word.")
        named = query(c, "What is proof of work?", document_ids=["pow"], fusion={"method": "epic"})
        chat = c.post("/v1/chat/completions", json={"model": "kvfuse", "max_tokens": 3, "messages": [
            {"role": "user", "content": "What are NFTs for?"}]})
        assert chat.status_code == 200, chat.text
        first, second, third = logged(holder, "What are NFTs for?")
    assert first["question"] == QUESTION and first["filters"] == {"topic": "todo"}
    assert first["system_prompt"] == "Answer in one word." and first["collections"] == ["default"]
    assert first["document_ids"] is None and first["top_k"] == 2 and first["retrieval_mode"] == "hybrid"
    assert (first["method"], first["recompute_ratio"]) == (rest["fusion"]["method"], rest["fusion"]["recompute_ratio"])
    assert second["document_ids"] == ["pow"] and second["collections"] is None and second["method"] == "epic"
    assert named["fusion"]["method"] == "epic"
    assert third["system_prompt"] is None and third["filters"] is None and third["method"] == "anchor"
    for e in (first, second, third):
        assert set(e) == FIELDS  # what picked the chunks and answered, not the answer
        assert e["size_bucket"] == "0-1024" and e["at"].endswith("Z")
    assert API_KEY not in (holder.server.data_dir / LOG_FILE).read_text()


def test_only_the_last_entries_are_kept(holder: Holder) -> None:
    questions = [f"Question {i}: what did Bronnie Ware list?" for i in range(5)]
    with make_client(holder.server) as c:
        for q in questions:
            query(c, q, document_ids=["todo"])
    assert [e["question"] for e in logged(holder, questions[-1])] == questions[-SIZE:]
    lines = (holder.server.data_dir / LOG_FILE).read_text().splitlines()
    assert len(lines) <= SIZE + 1  # rewritten once it holds a quarter more (at least one) than it keeps


def calibrate(h: Holder, out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    run_env = {**os.environ, "KVFUSE_DATA_DIR": str(h.server.data_dir), "KVFUSE_MODEL_CACHE_DIR": str(MODEL_CACHE),
               **ENV, **env}
    run_env.pop("KVFUSE_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "kvfuse.cli", "calibrate", "--target", "0.5", "--ratios", "0.15",
                           "--max-tokens", "3", "--out", str(out), "--dry-run", *args], cwd=REPO, env=run_env,
                          capture_output=True, text=True, timeout=500)


@pytest.mark.slow
def test_calibrate_measures_a_sample_of_the_log(holder: Holder, tmp_path: Path) -> None:
    with make_client(holder.server) as c:
        query(c, "What is proof of work?", document_ids=["pow"])
        query(c, QUESTION, filters={"topic": "todo"})
        query(c, "What are NFTs for?")
    logged(holder, "What are NFTs for?")
    out = calibrate(holder, tmp_path, "--from-log", "--sample", "3", "--seed", "7")
    assert out.returncode == 0, out.stderr[-3000:]
    table = (tmp_path / "calibrate.md").read_text()
    assert "3 queries" in table and "| anchor | 0-1024 | 0.15" in table
    assert json.loads((tmp_path / "calibrate.json").read_text())["queries"] == 3


def test_delete_empties_the_log_with_a_write_key_that_sees_every_collection(holder: Holder, tmp_path: Path) -> None:
    with make_client(holder.server) as c:
        query(c, QUESTION, document_ids=["todo"])
        logged(holder, QUESTION)
        with make_client(holder.server, key=READER) as reader, make_client(holder.server, key=TEAM) as team:
            assert reader.delete("/v1/query-log").json()["error"]["code"] == "read_only_key"
            assert team.delete("/v1/query-log").json()["error"]["code"] == "collection_forbidden"
            assert team.delete("/v1/query-log").status_code == 403
        with make_client(holder.server, key=None) as anon:
            assert anon.delete("/v1/query-log").status_code == 401
        assert entries(holder)
        resp = c.delete("/v1/query-log")
        assert resp.status_code == 200 and resp.json()["deleted"] >= 1, resp.text
    assert entries(holder) == []
    empty = calibrate(holder, tmp_path, "--from-log")
    assert empty.returncode == 2 and len(empty.stderr.strip().splitlines()) == 1 and "empty" in empty.stderr
    off = calibrate(holder, tmp_path, "--from-log", KVFUSE_FIDELITY__QUERY_LOG="false")
    assert off.returncode == 2 and "off" in off.stderr.strip()


@pytest.mark.slow
def test_a_server_with_the_log_off_writes_none(tmp_path: Path) -> None:
    env = {**ENV, "KVFUSE_FIDELITY__QUERY_LOG": "false"}
    with serving(tmp_path, env, setup=lambda c: ingest(c, [{"id": "owls", "text": "Barn owls hunt at night."}])) as h:
        with make_client(h.server) as c:
            query(c, "When do barn owls hunt?")
        assert not (h.server.data_dir / LOG_FILE).exists()
