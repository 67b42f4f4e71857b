"""Redis behind a password, an ACL user and TLS (kvfuse/store/redis_access.py): a private redis-server
with `requirepass`, a user of its own and a TLS port whose certificates come from a CA made for this
run. Every client kvfuse builds (the document index, the shared KV tier, the fleet's streams) connects
with the settings; a wrong password, a missing one or an unverifiable certificate is RedisAccessDenied,
one line that names the setting, never the password; `kvfuse serve` and `kvfuse worker` exit 2 with it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from redis_server import ThrowawayCA, free_port, start_redis, throwaway_ca, tls_args

from kvfuse.config import load_settings
from kvfuse.store import IndexUnavailableError
from kvfuse.store.records import DocumentRecord
from kvfuse.store.redis_access import RedisAccess, RedisAccessDenied
from kvfuse.store.redis_index import RedisIndex
from kvfuse.store.shared_tier import RedisTier

REPO = Path(__file__).resolve().parents[2]
PASSWORD = "s3cret-default"
USER, USER_PASSWORD = "kvfuse", "s3cret-user"


class Secured:
    def __init__(self, port: int, tls_port: int, ca: ThrowawayCA) -> None:
        self.port, self.tls_port, self.ca = port, tls_port, ca

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def tls_url(self) -> str:
        return f"rediss://127.0.0.1:{self.tls_port}/0"

    def tls_env(self) -> dict[str, str]:
        return {"KVFUSE_REDIS__TLS_CA_FILE": str(self.ca.ca), "KVFUSE_REDIS__TLS_CERT_FILE": str(self.ca.client_cert),
                "KVFUSE_REDIS__TLS_KEY_FILE": str(self.ca.client_key)}


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory):
    """redis-server: the default user's password, a user `kvfuse` with its own, a plain port and a TLS
    port that requires a client certificate."""
    root = tmp_path_factory.mktemp("secured-redis")
    try:
        ca = throwaway_ca(root / "tls")
    except (RuntimeError, subprocess.CalledProcessError) as err:
        pytest.skip(f"cannot make a throwaway CA: {err}")
    port, tls_port = free_port(), free_port()
    try:
        proc = start_redis(port, root, "--requirepass", PASSWORD, "--user", USER, "on", f">{USER_PASSWORD}", "~*",
                           "&*", "+@all", *tls_args(ca, tls_port, client_certs="yes"), password=PASSWORD)
    except RuntimeError as err:  # a redis-server built without TLS refuses --tls-port and exits
        pytest.skip(f"redis-server with TLS did not start (built without TLS?): {err}")
    yield Secured(port, tls_port, ca)
    proc.terminate()
    proc.wait(10)


def _settings(tmp_path: Path, url: str, **redis: object):
    return load_settings(data_dir=tmp_path, redis_url=url, redis=redis)


def _doc(doc_id: str) -> DocumentRecord:
    return DocumentRecord(id=doc_id, status="ready", metadata={}, collection="default", created_at=1.0)


def _every_client_works(access: RedisAccess, ns: str) -> None:
    """The document index, the shared tier and the fleet's asyncio client, all from `access`."""
    index = RedisIndex(access, ns)
    index.ping()
    index.put_document(_doc("d1"), [], [], [])
    assert [d.id for d in index.list_documents(0, 10)[0]] == ["d1"]
    tier = RedisTier(access, f"{ns}:kv", 1 << 20)
    assert tier.used_bytes() == 0 and tier.counters["errors"] == 0

    async def streams() -> list:
        r = access.async_client(decode_responses=True, read_timeout=False)
        try:
            await r.xadd(f"{ns}:jobs", {"job": "1"})
            return await r.xrange(f"{ns}:jobs")
        finally:
            await r.aclose()

    assert [fields for _, fields in asyncio.run(streams())] == [{"job": "1"}]
    index.close()


def test_a_password_from_a_file_reaches_the_index_the_shared_tier_and_the_streams(secured: Secured,
                                                                                  tmp_path: Path) -> None:
    secret = tmp_path / "redis-password"
    secret.write_text(PASSWORD + "\n")  # a secret file's trailing newline is not part of it
    access = RedisAccess.of(_settings(tmp_path, secured.url, password_file=str(secret)))
    assert access.password == PASSWORD
    access.check()
    _every_client_works(access, "pw-file")


def test_an_acl_user_in_the_url_or_in_the_settings(secured: Secured, tmp_path: Path) -> None:
    in_url = RedisAccess.of(_settings(tmp_path, f"redis://{USER}:{USER_PASSWORD}@127.0.0.1:{secured.port}/0"))
    _every_client_works(in_url, "acl-url")
    assert USER_PASSWORD not in in_url.where and "***" in in_url.where
    in_settings = RedisAccess.of(_settings(tmp_path, secured.url, username=USER, password=USER_PASSWORD))
    _every_client_works(in_settings, "acl-settings")


@pytest.mark.parametrize("redis", [{"password": "wrong"}, {}, {"username": USER, "password": PASSWORD}],
                         ids=["wrong-password", "no-password", "wrong-user-password"])
def test_a_refused_password_is_access_denied_not_an_outage(secured: Secured, tmp_path: Path, redis: dict) -> None:
    access = RedisAccess.of(_settings(tmp_path, secured.url, **redis))
    with pytest.raises(RedisAccessDenied, match="refused kvfuse's credentials") as err:
        access.check()
    assert "redis.password" in str(err.value) and "\n" not in str(err.value)
    assert PASSWORD not in str(err.value) and "wrong" not in str(err.value).split("(")[0]
    with pytest.raises(RedisAccessDenied, match="refused kvfuse's credentials"):  # the index says the same
        RedisIndex(access, "denied").ping()


def test_a_password_given_twice_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep one"):
        RedisAccess.of(_settings(tmp_path, "redis://:a@127.0.0.1:1/0", password="b"))
    with pytest.raises(ValueError, match="redis.password_file"):
        RedisAccess.of(_settings(tmp_path, "redis://127.0.0.1:1/0", password_file=str(tmp_path / "absent")))


def test_an_outage_is_not_access_denied(tmp_path: Path) -> None:
    access = RedisAccess.of(_settings(tmp_path, f"redis://127.0.0.1:{free_port()}/0", password="x"))
    access.check()  # nothing listens: kvfuse waits for Redis rather than refusing to start
    with pytest.raises(IndexUnavailableError) as err:
        RedisIndex(access, "down").ping()
    assert not isinstance(err.value, RedisAccessDenied)


def test_tls_with_the_ca_and_a_client_certificate(secured: Secured, tmp_path: Path) -> None:
    settings = _settings(tmp_path, secured.tls_url, password=PASSWORD, tls_ca_file=str(secured.ca.ca),
                         tls_cert_file=str(secured.ca.client_cert), tls_key_file=str(secured.ca.client_key))
    access = RedisAccess.of(settings)
    access.check()
    _every_client_works(access, "tls")


@pytest.mark.parametrize("redis", [{"tls_cert_file": "x"}, {"tls_ca_file": ""}], ids=["no-ca", "system-ca"])
def test_tls_that_does_not_verify_is_access_denied(secured: Secured, tmp_path: Path, redis: dict) -> None:
    c = secured.ca
    opts = {"password": PASSWORD, "tls_ca_file": str(c.ca), "tls_cert_file": str(c.client_cert),
            "tls_key_file": str(c.client_key)}
    if "tls_cert_file" in redis:  # the right CA, no client certificate: the server refuses the handshake
        opts.pop("tls_cert_file"), opts.pop("tls_key_file")
    else:  # no CA given: the system's CAs do not know the throwaway one
        opts.pop("tls_ca_file")
    with pytest.raises(RedisAccessDenied, match="TLS to Redis"):
        RedisAccess.of(_settings(tmp_path, secured.tls_url, **opts)).check()


def _cli(args: list[str], env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    full = {"PATH": "/usr/bin:/bin", "KVFUSE_DATA_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1", **env}
    return subprocess.run([sys.executable, "-m", "kvfuse.cli", *args], cwd=REPO, env=full, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("command", [["worker"], ["serve", "--workers", "0"], ["serve"]])
def test_serve_and_worker_exit_with_one_line_on_a_wrong_password(secured: Secured, tmp_path: Path,
                                                                  command: list[str]) -> None:
    out = _cli(command, {"KVFUSE_REDIS_URL": secured.url, "KVFUSE_REDIS__PASSWORD": "wrong"}, tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith(f"kvfuse {command[0]}: Redis at {secured.url} refused kvfuse's credentials")


def test_worker_exits_with_one_line_when_tls_does_not_verify(secured: Secured, tmp_path: Path) -> None:
    env = {"KVFUSE_REDIS_URL": secured.tls_url, "KVFUSE_REDIS__PASSWORD": PASSWORD}
    out = _cli(["worker"], env, tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "TLS to Redis" in out.stderr and "redis.tls_ca_file" in out.stderr
