"""Every Redis client of kvfuse is built here, from `redis_url` and the `redis` settings: the document
index (redis_index.py), the shared chunk KV tier (shared_tier.py), the fleet's job streams and heartbeats
(service/dispatch/fleet.py, service/worker/fleet_worker.py). One place, so a password or a TLS option
reaches all of them or none.

A refusal (a wrong password, an ACL user without the rights, a certificate that does not verify) is
`RedisAccessDenied`, a kind of `IndexUnavailableError` that says which setting to check: `kvfuse serve`
and `kvfuse worker` check for it once before anything loads and exit with one line, where an outage
(nothing listening yet) lets them start and wait (docs/deploy.md, "Exposing kvfuse").
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from kvfuse.store.errors import IndexUnavailableError

if TYPE_CHECKING:
    from kvfuse.config import Settings


class RedisAccessDenied(IndexUnavailableError):
    """Redis refused kvfuse's credentials or its TLS handshake: a setting to fix. To the store it is an
    unavailable index like any other (a write it missed is caught up once Redis accepts again); the CLI
    refuses to start on it, and /ready names it."""


def redact_url(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def read_secret(path: str, what: str) -> str:
    """A secret kept in a file (docker and Kubernetes secrets are files): its text without surrounding
    whitespace; a missing or empty file is an error naming the setting."""
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except OSError as err:
        raise ValueError(f"{what}: cannot read {path}: {err.strerror or err}") from None
    if not text:
        raise ValueError(f"{what}: {path} is empty")
    return text


@dataclass(frozen=True)
class RedisAccess:
    """Where Redis is and how to authenticate to it; `client()` builds a connection pool's client."""

    url: str
    username: str | None = None
    password: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_check_hostname: bool = True
    timeout_s: float = 5.0

    @classmethod
    def of(cls, settings: Settings) -> RedisAccess:
        """From the settings; raises ValueError when a password is given twice or its file is unreadable."""
        r = settings.redis
        password = r.password or (read_secret(r.password_file, "redis.password_file") if r.password_file else "")
        if password and urlsplit(settings.redis_url).password is not None:
            raise ValueError("redis_url holds a password and redis.password / redis.password_file gives one too: "
                             "keep one")
        return cls(url=settings.redis_url, username=r.username or None, password=password or None,
                   tls_ca_file=r.tls_ca_file or None, tls_cert_file=r.tls_cert_file or None,
                   tls_key_file=r.tls_key_file or None, tls_check_hostname=r.tls_check_hostname,
                   timeout_s=settings.store.redis_timeout_s)

    @classmethod
    def coerce(cls, where: RedisAccess | str, timeout_s: float) -> RedisAccess:
        """A plain URL (credentials in it, if any) is an access with no other option."""
        return where if isinstance(where, RedisAccess) else cls(url=where, timeout_s=timeout_s)

    @property
    def where(self) -> str:
        """The URL for messages: never the password."""
        return redact_url(self.url)

    def options(self, *, decode_responses: bool = False, read_timeout: bool = True) -> dict[str, Any]:
        """Keyword arguments of `Redis.from_url` (the URL's own user and password take precedence)."""
        opts: dict[str, Any] = {"decode_responses": decode_responses, "socket_connect_timeout": self.timeout_s}
        if read_timeout:  # a blocking stream read (XREAD BLOCK) sets its own
            opts["socket_timeout"] = self.timeout_s
        if self.username:
            opts["username"] = self.username
        if self.password:
            opts["password"] = self.password
        if self.url.startswith("rediss://"):
            opts["ssl_cert_reqs"] = "required"
            opts["ssl_check_hostname"] = self.tls_check_hostname
            if self.tls_ca_file:
                opts["ssl_ca_certs"] = self.tls_ca_file
            if self.tls_cert_file:
                opts["ssl_certfile"] = self.tls_cert_file
            if self.tls_key_file:
                opts["ssl_keyfile"] = self.tls_key_file
        return opts

    def client(self, *, decode_responses: bool = False, read_timeout: bool = True) -> Any:
        import redis

        return redis.Redis.from_url(self.url, **self.options(decode_responses=decode_responses,
                                                             read_timeout=read_timeout))

    def async_client(self, *, decode_responses: bool = False, read_timeout: bool = True) -> Any:
        import redis.asyncio as aioredis

        return aioredis.Redis.from_url(self.url, **self.options(decode_responses=decode_responses,
                                                                read_timeout=read_timeout))

    def denied(self, err: Exception) -> RedisAccessDenied | None:
        """`err` as a RedisAccessDenied when it is a refusal of the credentials or of TLS, else None."""
        import redis

        if isinstance(err, (redis.AuthenticationError, redis.exceptions.NoPermissionError)) or (
                isinstance(err, redis.ResponseError) and str(err).startswith(("NOAUTH", "WRONGPASS", "NOPERM"))):
            return RedisAccessDenied(f"Redis at {self.where} refused kvfuse's credentials ({err}): check "
                                     "redis.username and redis.password / redis.password_file (or the URL's)")
        if isinstance(err, redis.ConnectionError) and _is_tls_failure(err):
            return RedisAccessDenied(f"TLS to Redis at {self.where} failed ({err}): check redis.tls_ca_file "
                                     "(the CA that signed the server's certificate), the client certificate and "
                                     "that the URL says rediss:// only for a TLS port")
        return None

    def check(self) -> None:
        """PING once: RedisAccessDenied on a refusal; an outage (nothing listening) passes, since kvfuse
        waits for Redis to come back."""
        import redis

        client = self.client()
        try:
            client.ping()
        except redis.RedisError as err:
            denied = self.denied(err)
            if denied is not None:
                raise denied from None
        finally:
            client.close()


def redis_refusal(settings: Settings) -> str | None:
    """Why Redis will not take kvfuse's credentials or TLS settings (one line), else None. A Redis that
    does not answer yet passes: `kvfuse serve` and `kvfuse worker` start and wait for it."""
    try:
        RedisAccess.of(settings).check()
    except (ValueError, RedisAccessDenied) as err:
        return str(err)
    return None


def _is_tls_failure(err: Exception) -> bool:
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, ssl.SSLError) or "SSL" in str(seen) or "certificate" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
