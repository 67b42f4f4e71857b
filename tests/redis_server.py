"""A private redis-server for tests that stop and restart Redis (no persistence unless asked), so the
shared server on 6379 is never disturbed; a free loopback port to put it (or a kvfuse server) on; and the
Redis the other tests share: the one configured when it answers, else a private one (a fresh machine
runs no Redis)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(port: int, workdir: Path, *extra: str, password: str | None = None) -> subprocess.Popen:
    """redis-server on `port`, its files (if it saves) in `workdir`, with `extra` arguments (a password,
    ACL users, a TLS port); returns once it answers PING (with `password`, when it requires one)."""
    import redis

    if shutil.which("redis-server") is None:
        raise RuntimeError("redis-server is not installed (these tests start a private one)")
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return answering(proc, redis.Redis(port=port, password=password, socket_connect_timeout=0.5),
                     f"redis-server did not start on port {port}")


def answering(proc: subprocess.Popen, client, failure: str) -> subprocess.Popen:
    """`proc` once `client` gets an answer to PING (5 s at most); else `proc` is killed and `failure` raised."""
    import redis

    for _ in range(100):
        try:
            client.ping()
            return proc
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(failure)


def answers(url: str) -> bool:
    """Whether a Redis answers PING at `url`."""
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2).ping())
    except redis.exceptions.RedisError:
        return False


def shared_or_private(url: str, workdir: Path) -> tuple[str, subprocess.Popen | None]:
    """(`url`, None) when a Redis answers there; else a private redis-server started on a free port, as
    (its URL, with the same database number, and its process, for the caller to stop). Raises
    RuntimeError when neither is possible (redis-server not installed)."""
    if answers(url):
        return url, None
    port = free_port()
    proc = start_redis(port, workdir)
    parts = urlsplit(url)
    return urlunsplit(("redis", f"127.0.0.1:{port}", parts.path or "/0", "", "")), proc


@dataclass(frozen=True)
class ThrowawayCA:
    """A CA made for one test run, a server certificate for 127.0.0.1 / localhost and a client
    certificate, both signed by it (PEM files)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def throwaway_ca(folder: Path) -> ThrowawayCA:
    """Made with the `openssl` command (P-256 keys, valid one day)."""
    if shutil.which("openssl") is None:
        raise RuntimeError("openssl is not installed (the TLS tests make their certificates with it)")
    folder.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=kvfuse-test-ca")
    (folder / "leaf.cnf").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nauthorityKeyIdentifier=keyid,issuer\n"
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth,clientAuth\n")
    for name in ("server", "client"):
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.crt", "-days", "1", "-extfile", "leaf.cnf")
    return ThrowawayCA(folder / "ca.crt", folder / "server.crt", folder / "server.key", folder / "client.crt",
                       folder / "client.key")


def tls_args(ca: ThrowawayCA, tls_port: int, *, client_certs: str = "no") -> list[str]:
    """redis-server arguments for a TLS port with the throwaway CA's server certificate; `client_certs`:
    no | optional | yes (tls-auth-clients)."""
    return ["--tls-port", str(tls_port), "--tls-cert-file", str(ca.server_cert), "--tls-key-file",
            str(ca.server_key), "--tls-ca-cert-file", str(ca.ca), "--tls-auth-clients", client_certs]

