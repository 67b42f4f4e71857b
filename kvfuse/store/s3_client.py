"""S3 clients of the object store tier (object_tier.py), built from the `object_store` settings.

Two clients with the same five calls (get, put, delete, exists, keys): `ObstoreClient` (obstore, Rust's
object_store crate: requests run outside the GIL on its own runtime) serves; `Boto3Client` (boto3) is
kept as the baseline `kvfuse bench object-store` compares it with, the measurement that chose it
(docs/results/object-store/README.md). Keys here are object names under the URL's prefix.

Credentials, as every S3 tool reads them: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and
AWS_SESSION_TOKEN) from the environment, else `object_store.credentials_file` (an AWS shared credentials
file, section `object_store.profile`), else the client's own discovery (an instance role).
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from kvfuse.store.errors import StoreError

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig, S3Config


class ObjectStoreError(StoreError):
    """The object store did not answer, or refused the request (anything but a missing object)."""


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # "" or ending in "/"

    @classmethod
    def parse(cls, url: str) -> S3Location:
        if not url.startswith("s3://"):
            raise ValueError(f"an object store URL is s3://bucket/prefix, not {url!r}")
        bucket, _, prefix = url[5:].partition("/")
        if not bucket:
            raise ValueError(f"no bucket in {url!r}")
        prefix = prefix.strip("/")
        return cls(bucket, f"{prefix}/" if prefix else "")


def credentials(cfg: Any) -> dict[str, str]:
    """{access_key_id, secret_access_key[, session_token]} from the environment, else the credentials
    file's profile; {} to leave it to the client's discovery. A named file that lacks them is an error."""
    env = os.environ
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        out = {"access_key_id": env["AWS_ACCESS_KEY_ID"], "secret_access_key": env["AWS_SECRET_ACCESS_KEY"]}
        if env.get("AWS_SESSION_TOKEN"):
            out["session_token"] = env["AWS_SESSION_TOKEN"]
        return out
    if not cfg.credentials_file:
        return {}
    parser = configparser.ConfigParser()
    try:
        parser.read_string(Path(cfg.credentials_file).read_text())
        section = parser[cfg.profile]
        out = {"access_key_id": section["aws_access_key_id"], "secret_access_key": section["aws_secret_access_key"]}
    except (OSError, configparser.Error, KeyError) as err:
        raise ObjectStoreError(f"object_store.credentials_file {cfg.credentials_file}: no aws_access_key_id and "
                               f"aws_secret_access_key in [{cfg.profile}] ({err!r})") from None
    if section.get("aws_session_token"):
        out["session_token"] = section["aws_session_token"]
    return out


class S3Client(Protocol):
    location: S3Location

    def get(self, key: str) -> bytes | memoryview | None: ...
    def put(self, key: str, data: bytes) -> None: ...
    def delete(self, key: str) -> None: ...
    def exists(self, key: str) -> bool: ...
    def keys(self) -> Iterator[str]: ...


class ObstoreClient:
    """obstore's S3Store. A PUT is one request (object_store's put is a single PutObject below its
    multipart threshold, which a chunk blob is under): S3 makes the object visible whole or not at all."""

    def __init__(self, cfg: Any) -> None:
        import obstore
        from obstore.store import S3Store

        self._ob = obstore
        self.location = S3Location.parse(cfg.url)
        config: S3Config = {"region": cfg.region, "virtual_hosted_style_request": not cfg.path_style}
        if cfg.endpoint:
            config["endpoint"] = cfg.endpoint
        config |= cast("S3Config", credentials(cfg))  # its keys are S3Config keys
        options: ClientConfig = {"timeout": f"{cfg.timeout_s}s", "connect_timeout": f"{min(cfg.timeout_s, 5.0)}s",
                                   "allow_http": cfg.endpoint.startswith("http://")}
        if cfg.ca_file:
            options["root_certificate"] = Path(cfg.ca_file).read_bytes()
        # Few retries: a read that fails is recomputed and a write is retried by the tier, so waiting long
        # for an object store that is down only delays the query.
        retry: RetryConfig = {"max_retries": 1, "retry_timeout": timedelta(seconds=cfg.timeout_s)}
        self._store = S3Store(self.location.bucket, prefix=self.location.prefix or None, config=config,
                              client_options=options, retry_config=retry)

    def _error(self, what: str, key: str, err: Exception) -> ObjectStoreError:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]  # obstore appends a debug dump
        return ObjectStoreError(f"object store {what} {self.location.prefix}{key}: {first}")

    def get(self, key: str) -> memoryview | None:
        try:
            return memoryview(self._ob.get(self._store, key).bytes())
        except FileNotFoundError:
            return None
        except Exception as err:  # obstore raises its own classes per failure; every one is "unavailable"
            raise self._error("get", key, err) from None

    def put(self, key: str, data: bytes) -> None:
        try:
            self._ob.put(self._store, key, data)
        except Exception as err:
            raise self._error("put", key, err) from None

    def delete(self, key: str) -> None:
        try:
            self._ob.delete(self._store, key)
        except FileNotFoundError:
            return
        except Exception as err:
            raise self._error("delete", key, err) from None

    def exists(self, key: str) -> bool:
        try:
            self._ob.head(self._store, key)
            return True
        except FileNotFoundError:
            return False
        except Exception as err:
            raise self._error("head", key, err) from None

    def keys(self) -> Iterator[str]:
        try:
            for batch in self._ob.list(self._store, chunk_size=1000):
                for meta in batch:
                    yield meta["path"]
        except Exception as err:
            raise self._error("list", "", err) from None


class Boto3Client:
    """boto3's S3 client (thread-safe; one connection pool sized for `pool` parallel requests)."""

    def __init__(self, cfg: Any, pool: int = 32) -> None:
        import boto3
        from botocore.config import Config

        self.location = S3Location.parse(cfg.url)
        creds = credentials(cfg)
        self._client = boto3.client(
            "s3", endpoint_url=cfg.endpoint or None, region_name=cfg.region, verify=cfg.ca_file or None,
            aws_access_key_id=creds.get("access_key_id"), aws_secret_access_key=creds.get("secret_access_key"),
            aws_session_token=creds.get("session_token"),
            config=Config(s3={"addressing_style": "path" if cfg.path_style else "virtual"},
                          connect_timeout=min(cfg.timeout_s, 5.0), read_timeout=cfg.timeout_s,
                          retries={"max_attempts": 2}, max_pool_connections=pool))
        self._missing = self._client.exceptions.NoSuchKey

    def _name(self, key: str) -> str:
        return self.location.prefix + key

    def get(self, key: str) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            body: bytes = self._client.get_object(Bucket=self.location.bucket, Key=self._name(key))["Body"].read()
            return body
        except self._missing:
            return None
        except ClientError as err:
            raise ObjectStoreError(f"object store get {self._name(key)}: {err}") from None

    def put(self, key: str, data: bytes) -> None:
        self._client.put_object(Bucket=self.location.bucket, Key=self._name(key), Body=data)

    def delete(self, key: str) -> None:
        self._client.delete_object(Bucket=self.location.bucket, Key=self._name(key))

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._client.head_object(Bucket=self.location.bucket, Key=self._name(key))
            return True
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise ObjectStoreError(f"object store head {self._name(key)}: {err}") from None

    def keys(self) -> Iterator[str]:
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.location.bucket, Prefix=self.location.prefix)
        for page in pages:
            for obj in page.get("Contents", []):
                yield obj["Key"][len(self.location.prefix):]


CLIENTS = {"obstore": ObstoreClient, "boto3": Boto3Client}


def open_client(cfg: Any, kind: str = "obstore") -> S3Client:
    """The client of `cfg` (the object_store settings) of `kind`."""
    return cast(S3Client, CLIENTS[kind](cfg))
