"""A fleet through a Redis that is locked as docker-compose.fleet.yml locks it: its own Redis command (no
default user, the ACL user `kvfuse` with a password from a secret file, no administrative command, only
kvfuse's keys), plus a TLS port that requires a client certificate from a CA made for this test. The API
(`kvfuse serve --workers 0`) and a `kvfuse worker` reach it over rediss:// with the password from a file:
ingestion, a query and the shared chunk KV tier work; once Redis takes another password, /ready says so."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest
import redis
from fleet_helpers import WorkerProcess, fleet_env, start_api, wait_workers
from redis_server import free_port, throwaway_ca, tls_args
from service_helpers import API_KEY, ingest, make_client, until
from test_deploy import start_compose_redis

pytestmark = pytest.mark.slow

PASSWORD = "fleet-secret-0123"
SMALL = {"KVFUSE_RETRIEVER__CHUNK_TOKENS": "128", "KVFUSE_RETRIEVER__TOP_K": "2",
         "KVFUSE_MODEL__MAX_CONTEXT_TOKENS": "1024", "KVFUSE_SERVER__MAX_RUNNING_REQUESTS": "2"}


def test_a_fleet_through_a_password_and_tls_and_ready_says_when_redis_refuses(tmp_path: Path,
                                                                                essays3: dict[str, str]) -> None:
    try:
        ca = throwaway_ca(tmp_path / "tls")
    except (RuntimeError, subprocess.CalledProcessError) as err:
        pytest.skip(f"cannot make a throwaway CA: {err}")
    port, tls_port = free_port(), free_port()
    extra = tls_args(ca, tls_port, client_certs="yes")
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir()
    proc = start_compose_redis("docker-compose.fleet.yml", redis_dir, port, PASSWORD, *extra)
    secret = tmp_path / "redis_password"
    secret.write_text(PASSWORD)
    # kvfuse's own key prefixes (the defaults): the compose ACL lets the user touch nothing else.
    env = {**fleet_env(f"rediss://127.0.0.1:{tls_port}/0", "kvfuse"), **SMALL,
           "KVFUSE_REDIS__USERNAME": "kvfuse", "KVFUSE_REDIS__PASSWORD_FILE": str(secret),
           "KVFUSE_REDIS__TLS_CA_FILE": str(ca.ca), "KVFUSE_REDIS__TLS_CERT_FILE": str(ca.client_cert),
           "KVFUSE_REDIS__TLS_KEY_FILE": str(ca.client_key)}
    worker = WorkerProcess("a", tmp_path, **env).start()
    api = None
    try:
        api = start_api(tmp_path, env)
        wait_workers(api.url, {"a"}, workers=[worker])
        with make_client(api) as c:
            ingest(c, [{"id": "todo", "text": essays3["todo"][:1500]}])
            body = c.post("/v1/query", json={"query": "What did Bronnie Ware make a list of?",
                                             "max_tokens": 4}).json()
            assert body["worker"] == "a" and body["answer"] and body["sources"][0]["document_id"] == "todo"
        admin = redis.Redis(port=port, username="kvfuse", password=PASSWORD)
        assert admin.exists("kvfuse:doc:todo")  # the document index
        assert next(admin.scan_iter("kvfuse:fleet:kv:meta:*"), None) is not None  # the shared KV tier

        # Redis comes back with another password: /ready says which setting to check.
        proc.terminate()
        proc.wait(10)
        proc = start_compose_redis("docker-compose.fleet.yml", redis_dir, port, "another-password", *extra)

        def refused() -> dict | None:
            resp = httpx.get(f"{api.url}/ready", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
            msg = resp.json().get("error", {}).get("message", "")
            return resp.json() if resp.status_code == 503 and "refused kvfuse's credentials" in msg else None

        body = until(refused, 60, "/ready did not report the refused password")
        assert PASSWORD not in body["error"]["message"] and "redis.password" in body["error"]["message"]
        anonymous = httpx.get(f"{api.url}/ready", timeout=10).json()  # details only for a valid key
        assert "credentials" not in anonymous["error"]["message"]
    finally:
        if api is not None:
            api.stop()
        worker.stop()
        proc.terminate()
        proc.wait(10)
