"""`kvfuse serve`, `kvfuse ingest`, `kvfuse query` (registered by kvfuse.cli; heavy imports stay inside
the command functions so `kvfuse --help` is instant)."""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvfuse.service.rag.file_types import (
    FILE_SUFFIXES as TEXT_SUFFIXES,  # what folders give: what the server reads
)

_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._:@-]+")


def bounded(kind: type, low: float, high: float | None = None, *, above: bool = False) -> Any:
    """An argparse type: a finite number of `kind`, at least `low` (greater than `low` with `above`), at
    most `high`. Out of range is a usage error (exit 2) before anything runs, rather than a request the
    server refuses later or, worse, one it accepts (an empty batch)."""
    import math

    wanted = (f"> {low:g}" if above else f">= {low:g}") + (f" and <= {high:g}" if high is not None else "")

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
                                             ) from None
        ok = math.isfinite(value) and (value > low if above else value >= low) and (high is None or value <= high)
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
        return value

    return parse


def register(sub: argparse._SubParsersAction) -> None:
    """Add this package's subcommands; import nothing heavy here."""
    p = sub.add_parser("serve", help="run the HTTP service (API process + model worker)")
    p.add_argument("--host", help="bind address (default: server.host)")
    p.add_argument("--port", type=bounded(int, 1, 65535), help="bind port (default: server.port)")
    p.add_argument("--workers", type=bounded(int, 0),
                   help="local worker processes (default: server.workers); 0 = dispatch to `kvfuse worker`s "
                        "through Redis (needs redis_url)")
    p.set_defaults(func=_serve)

    p = sub.add_parser("worker", help="run a model worker of a fleet: takes jobs from Redis (needs redis_url)")
    p.add_argument("--name", help="this worker's name in answers and /ready (default: fleet.worker_name, else host-pid)")
    p.add_argument("--health", action="store_true",
                   help="exit 0 when a worker of this host has a live heartbeat, else 1 (a container healthcheck)")
    p.set_defaults(func=_worker)

    p = sub.add_parser("ingest", help="ingest files (text, Markdown, PDF, DOCX, HTML) or folders (into a running "
                                      "server, or --local)")
    p.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="files, or folders (searched recursively)")
    _client_args(p)
    p.add_argument("--local", action="store_true",
                   help="no server: run the service in this process on the configured data dir for the duration "
                        "(no other server may be using that data dir)")
    p.add_argument("--on-conflict", choices=("skip", "overwrite", "fail"), default="skip",
                   help="when a document id exists already (default: skip)")
    p.add_argument("--batch", type=bounded(int, 1), default=16, help="documents per request (default: 16)")
    p.add_argument("--no-wait", action="store_true", help="return once queued instead of waiting for ready")
    p.add_argument("--collection", help="the collection the documents go to (default: default)")
    p.set_defaults(func=_unreachable_is_one_line("ingest", _ingest))

    p = sub.add_parser("query", help="ask a question; the answer streams as it is generated")
    p.add_argument("question")
    _client_args(p)
    p.add_argument("--method", help="fusion method (default: fusion.method)")
    p.add_argument("--ratio", type=bounded(float, 0, 1),
                   help="recompute ratio in [0, 1] (default: fusion.recompute_ratio)")
    p.add_argument("--doc", action="append", dest="docs", metavar="ID",
                   help="answer from exactly these documents, in this order (repeatable)")
    p.add_argument("--top-k", type=bounded(int, 1), help="chunks to retrieve (default: retriever.top_k)")
    p.add_argument("--mode", choices=("dense", "keyword", "hybrid"), help="retrieval mode (default: retriever.mode)")
    p.add_argument("--collection", action="append", dest="collections", metavar="NAME",
                   help="search this collection (repeatable; default: the default collection)")
    p.add_argument("--max-tokens", type=bounded(int, 1),
                   help="answer length limit (default: generation.max_tokens)")
    p.set_defaults(func=_unreachable_is_one_line("query", _query))


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="server URL (default: server.url, else http://server.host:server.port)")
    p.add_argument("--api-key", help="API key (default: $KVFUSE_API_KEY or the file $KVFUSE_API_KEY_FILE names, "
                                     "else the first of server.api_keys)")
    p.add_argument("--timeout", type=bounded(float, 0, above=True), default=600.0,
                   help="seconds to wait for the server (default: 600)")


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvfuse.config import get_settings
    from kvfuse.service.api.auth import KeyRing, check_bind
    from kvfuse.store.redis_access import redis_refusal

    s = get_settings()
    server = s.server.model_copy(update={k: v for k, v in (("host", args.host), ("port", args.port),
                                                            ("workers", args.workers)) if v is not None})
    if server.workers == 0 and not s.redis_url:
        print("kvfuse serve: --workers 0 dispatches to `kvfuse worker`s through Redis: set redis_url", file=sys.stderr)
        return 2
    settings = s.model_copy(update={"server": server})
    try:
        check_bind(server.host, KeyRing.of(settings), server)
        check_listen(server.host, server.port)
    except (OSError, ValueError) as err:  # check_bind's PermissionError is an OSError; a bad key file ValueError
        print(f"kvfuse serve: {err}", file=sys.stderr)
        return 2
    if s.redis_url and (why := redis_refusal(s)):
        print(f"kvfuse serve: {why}", file=sys.stderr)
        return 2
    from kvfuse.service.api.app import create_app  # after the checks: it imports the index libraries

    uvicorn.run(create_app(settings), host=server.host, port=server.port, log_level=s.log_level,
                timeout_graceful_shutdown=5)
    return 0


def check_listen(host: str, port: int) -> None:
    """Raise OSError (one line) unless `host:port` can be listened on now: an unknown host, an address
    not on this machine, a port in use or not permitted. Checked before the store, the model and the
    worker load, rather than found by the server after all of that."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as err:
        raise OSError(f"cannot resolve the bind address {host!r}: {err.strerror}") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will: TIME_WAIT is no obstacle
        try:
            sock.bind(address)
        except OSError as err:
            raise OSError(f"cannot listen on {host}:{port}: {err.strerror}") from None


def _server_url(args: argparse.Namespace) -> str:
    from kvfuse.config import get_settings

    return args.url or get_settings().server.base_url


def _unreachable_is_one_line(name: str, command: Any) -> Any:
    """A server that cannot be reached is one line naming the URL and what to check, not a traceback."""

    def run(args: argparse.Namespace) -> int:
        import httpx

        try:
            return command(args)
        except httpx.TransportError as err:
            url = _server_url(args)
            what = "timed out" if isinstance(err, httpx.TimeoutException) else "cannot connect"
            print(f"kvfuse {name}: {what} to {url} ({type(err).__name__}: {err or 'no detail'}); "
                  f"is kvfuse serve running on {url}? (--url or server.url picks another server)", file=sys.stderr)
            return 1

    return run


def _worker(args: argparse.Namespace) -> int:
    from kvfuse.config import get_settings
    from kvfuse.service.worker.fleet_worker import worker_command
    from kvfuse.store.redis_access import redis_refusal

    s = get_settings()
    if not s.redis_url:
        print("kvfuse worker: set redis_url (KVFUSE_REDIS_URL): workers join the fleet through Redis", file=sys.stderr)
        return 2
    if why := redis_refusal(s):
        print(f"kvfuse worker: {why}", file=sys.stderr)
        return 2
    if args.health:
        import socket

        from kvfuse.service.wire.fleet_keys import FleetKeys, read_heartbeats
        from kvfuse.store.redis_access import RedisAccess

        beats = read_heartbeats(RedisAccess.of(s).client(decode_responses=True), FleetKeys(s.fleet.namespace))
        return 0 if any(b.get("host") == socket.gethostname() for b in beats.values()) else 1
    if args.name:
        s = s.model_copy(update={"fleet": s.fleet.model_copy(update={"worker_name": args.name})})
    return worker_command(s)


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
    return httpx.Client(base_url=_server_url(args), headers=headers,
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


def _ingest(args: argparse.Namespace) -> int:
    import time

    from tqdm import tqdm

    from kvfuse.service.cli_upload import JSON_SUFFIXES, upload

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


def _query(args: argparse.Namespace) -> int:
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
