"""The client commands `kvfuse ingest` and `kvfuse query` (registered by kvfuse/service/cli.py): they talk
to a running server over HTTP (or one started in this process with `--local`). Files the server parses
(PDF, DOCX, HTML, Markdown) are sent as the server takes a file, multipart/form-data with its `file`
field (api/uploads.py), one request per file; plain text files travel as JSON batches (fewer requests,
nothing to parse). Heavy imports stay inside the functions so `kvfuse --help` is instant."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvfuse.service.rag.file_types import (
    FILE_SUFFIXES as TEXT_SUFFIXES,  # what folders give: what the server reads
)

_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._:@-]+")
JSON_SUFFIXES = frozenset({".txt", ".text", ".rst"})  # sent as JSON text, in batches


def upload(http: Any, path: Path, doc_id: str, *, on_conflict: str, collection: str | None) -> Any:
    """POST one file as multipart/form-data; returns the response (a JobOut or Submitted body on success)."""
    form = {"id": doc_id, "on_conflict": on_conflict, "metadata": json.dumps({"source": str(path)})}
    if collection:
        form["collection"] = collection
    with path.open("rb") as f:
        return http.post("/v1/documents", files={"file": (path.name, f)}, data=form)


def server_url(args: argparse.Namespace) -> str:
    from kvfuse.config import get_settings

    return args.url or get_settings().server.base_url


def client_key(s: Any) -> str | None:
    """The key a client sends by default: `api_key` (KVFUSE_API_KEY), else `api_key_file`'s, else the
    first full-access key of server.api_keys."""
    from kvfuse.store.redis_access import read_secret

    if s.api_key:
        return s.api_key
    if s.api_key_file:
        return read_secret(s.api_key_file, "api_key_file")
    keys = s.server.api_keys
    return keys[0] if isinstance(keys, list) and keys else None


def _client(args: argparse.Namespace) -> Any:
    import logging

    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would bury the output
    from kvfuse.config import get_settings

    key = args.api_key or client_key(get_settings())
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server_url(args), headers=headers,
                        timeout=httpx.Timeout(args.timeout, connect=10.0))


def _fail(resp: Any) -> str:
    try:
        err = resp.json()["error"]
        return f"HTTP {resp.status_code}: {err['message']}"
    except Exception:  # noqa: BLE001 - any non-JSON answer
        return f"HTTP {resp.status_code}: {resp.text[:300]}"


def collect_files(paths: list[Path]) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            files.extend(sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"no such file or folder: {p}")
    return files


def doc_id_for(path: Path) -> str:
    """A document id from a file name: its stem with unsafe characters replaced."""
    stem = _ID_UNSAFE.sub("-", path.stem).strip("-._:@") or "document"
    return stem[:200]


@contextlib.contextmanager
def local_server(timeout: float) -> Iterator[str]:
    """The service on a free loopback port in this process (API in a thread, the usual worker process)."""
    import socket
    import threading

    import uvicorn

    from kvfuse.config import get_settings
    from kvfuse.service.api.app import create_app
    from kvfuse.service.probe import wait_ready

    s = get_settings()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings = s.model_copy(update={"server": s.server.model_copy(update={"host": "127.0.0.1", "port": port})})
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="kvfuse-local-server", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_ready(url, timeout, alive=thread.is_alive):
            raise RuntimeError("the local service did not become ready")
        yield url
    finally:
        server.should_exit = True
        thread.join(60)


def ingest_command(args: argparse.Namespace) -> int:
    import time

    from tqdm import tqdm


    try:
        files = collect_files(args.paths)
    except FileNotFoundError as err:
        print(f"kvfuse ingest: {err}", file=sys.stderr)
        return 2
    if not files:
        print("kvfuse ingest: no text files found", file=sys.stderr)
        return 2
    docs: list[dict] = []
    uploads = [f for f in files if f.suffix.lower() not in JSON_SUFFIXES]
    for f in files:
        if f in uploads:
            continue
        try:
            docs.append({"id": doc_id_for(f), "text": f.read_text(encoding="utf-8"), "metadata": {"source": str(f)}})
        except UnicodeDecodeError:
            print(f"skipped {f}: not UTF-8 text", file=sys.stderr)
    ok = 0
    pending: dict[str, str] = {}  # job id -> document id
    with contextlib.ExitStack() as stack:
        if args.local:
            args.url = stack.enter_context(local_server(args.timeout))
            args.no_wait = False  # the local service ends with this command: wait for every job
        http = stack.enter_context(_client(args))
        http.get("/health")  # an unreachable server is reported before any progress bar is drawn
        bar = stack.enter_context(tqdm(total=len(docs) + len(uploads), unit="doc", desc="ingest"))
        for f in uploads:  # files the server parses: one multipart request each
            resp = upload(http, f, doc_id_for(f), on_conflict=args.on_conflict, collection=args.collection)
            if resp.status_code >= 400:
                bar.write(f"{f} refused: {_fail(resp)}")
                bar.update(1)
            elif (item := resp.json()).get("job_id") and not item.get("skipped") and not args.no_wait:
                pending[item["job_id"]] = item["document_id"]
            else:
                ok += 1
                bar.update(1)
        for i in range(0, len(docs), max(1, args.batch)):
            batch = docs[i : i + args.batch]
            body = {"documents": batch, "on_conflict": args.on_conflict}
            if args.collection:
                body["collection"] = args.collection
            resp = http.post("/v1/documents", json=body)
            if resp.status_code >= 400:
                bar.write(f"batch of {len(batch)} refused: {_fail(resp)}")
                bar.update(len(batch))
                continue
            for item in resp.json()["documents"]:
                if item.get("job_id") and not item.get("skipped") and not args.no_wait:
                    pending[item["job_id"]] = item["document_id"]
                else:
                    ok += 1
                    bar.update(1)
        while pending:
            for job_id in list(pending):
                resp = http.get(f"/v1/jobs/{job_id}")
                job = resp.json() if resp.status_code == 200 else {"status": "failed", "error": _fail(resp)}
                if job["status"] in ("ready", "failed", "cancelled"):
                    doc_id = pending.pop(job_id)
                    if job["status"] == "ready":
                        ok += 1
                    else:
                        bar.write(f"{doc_id}: {job['status']}: {job.get('error')}")
                    bar.update(1)
            if pending:
                time.sleep(0.5)
    print(f"{ok} of {len(files)} documents {'queued' if args.no_wait else 'ingested'}")
    return 0 if ok == len(files) else 1


def query_body(args: argparse.Namespace) -> dict[str, Any]:
    """The /v1/query request `kvfuse query` sends (streamed); unset options take the server's defaults."""
    body: dict[str, Any] = {"query": args.question, "stream": True}
    if args.docs:
        body["document_ids"] = args.docs
    if args.top_k is not None:
        body["top_k"] = args.top_k
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    fusion = {k: v for k, v in (("method", args.method), ("recompute_ratio", args.ratio)) if v is not None}
    if fusion:
        body["fusion"] = fusion
    retrieval = {k: v for k, v in (("mode", args.mode), ("collections", args.collections)) if v is not None}
    if retrieval:
        body["retrieval"] = retrieval
    return body


def query_command(args: argparse.Namespace) -> int:
    import json

    body = query_body(args)
    sources: list[dict] = []
    final: dict = {}
    with _client(args) as http, http.stream("POST", "/v1/query", json=body) as resp:
        if resp.status_code >= 400:
            resp.read()
            print(f"kvfuse query: {_fail(resp)}", file=sys.stderr)
            return 1
        event = None
        for line in resp.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if event == "sources":
                    sources = payload["sources"]
                    if payload.get("warning"):
                        print(f"warning: {payload['warning']}", file=sys.stderr)
                elif event == "token":
                    print(payload["text"], end="", flush=True)
                elif event == "done":
                    final = payload
                elif event == "error":
                    print(f"\nkvfuse query: {payload['error']['message']}", file=sys.stderr)
                    return 1
    print()
    print("\nsources:")
    for s in sources:
        print(f"  {s['document_id']} #{s['chunk_index']}  score {s['score']:.3f}")
    if final:
        t, u = final["timings"], final["usage"]
        print(f"timings: ttft {t['ttft_ms']:.0f} ms, decode {t['decode_ms']:.0f} ms, total {t['total_ms']:.0f} ms "
              f"(retrieval {t['retrieval_ms']:.0f} ms, kv load {t['kv_load_ms']:.0f} ms)")
        print(f"tokens: prompt {u['prompt_tokens']} (reused {u['cached_tokens']}, recomputed "
              f"{u['recomputed_tokens']}), completion {u['completion_tokens']}; fusion {final['fusion']['method']} "
              f"r={final['fusion']['recompute_ratio']}")
    return 0
