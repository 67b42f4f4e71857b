"""`kvfuse serve`, `kvfuse worker`, and the arguments of `kvfuse ingest` and `kvfuse query` (their commands:
cli_client.py); registered by kvfuse.cli. Heavy imports stay inside the command functions so `kvfuse --help`
is instant."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvfuse.service.cli_client import ingest_command, query_command, server_url


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
    p.add_argument("--health", action="store_true",
                   help="probe the server on this host instead: exit 0 when its /health answers ok, else 1, "
                        "printing its state (starting, failed and why): a container healthcheck")
    p.set_defaults(func=_serve)

    p = sub.add_parser("worker", help="run a model worker of a fleet: takes jobs from Redis (needs redis_url)")
    p.add_argument("--name", help="this worker's name in answers and /ready (default: fleet.worker_name, else host-pid)")
    p.add_argument("--health", action="store_true",
                   help="exit 0 when a worker on this data dir has loaded its model and joined, else 1, printing "
                        "its state (starting, failed and why): a container healthcheck; it needs no Redis")
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
    p.set_defaults(func=_unreachable_is_one_line("ingest", ingest_command))

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
    p.set_defaults(func=_unreachable_is_one_line("query", query_command))


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
    if args.health:
        from kvfuse.service.cli_client import client_key
        from kvfuse.service.health import probe_server

        code, line = probe_server(server.model_copy(update={"url": ""}).base_url, client_key(s))
        print(f"kvfuse serve --health: {line}", file=sys.stdout if code == 0 else sys.stderr)
        return code
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
                timeout_graceful_shutdown=5, limit_concurrency=server.max_connections)
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


def _unreachable_is_one_line(name: str, command: Any) -> Any:
    """A server that cannot be reached is one line naming the URL and what to check, not a traceback."""

    def run(args: argparse.Namespace) -> int:
        import httpx

        try:
            return command(args)
        except httpx.TransportError as err:
            url = server_url(args)
            what = "timed out" if isinstance(err, httpx.TimeoutException) else "cannot connect"
            print(f"kvfuse {name}: {what} to {url} ({type(err).__name__}: {err or 'no detail'}); "
                  f"is kvfuse serve running on {url}? (--url or server.url picks another server)", file=sys.stderr)
            return 1

    return run


def _worker(args: argparse.Namespace) -> int:
    from kvfuse.config import get_settings

    s = get_settings()
    if args.health:  # the worker's own status file (health.py): no Redis needed, so an outage is no failure,
        # and no model code imported, so a probe every few seconds stays light
        from kvfuse.service.health import WorkerStatus

        code, line = WorkerStatus.probe(s.data_dir)
        print(f"kvfuse worker --health: {line}", file=sys.stdout if code == 0 else sys.stderr)
        return code
    from kvfuse.service.worker.fleet_worker import worker_command
    from kvfuse.store.redis_access import redis_refusal

    if not s.redis_url:
        print("kvfuse worker: set redis_url (KVFUSE_REDIS_URL): workers join the fleet through Redis", file=sys.stderr)
        return 2
    if why := redis_refusal(s):
        print(f"kvfuse worker: {why}", file=sys.stderr)
        return 2
    if args.name:
        s = s.model_copy(update={"fleet": s.fleet.model_copy(update={"worker_name": args.name})})
    return worker_command(s)
