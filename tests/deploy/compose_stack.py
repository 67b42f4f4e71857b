"""A compose project of the deployment test, and how the test measures its phases.

`Stack` runs `docker compose` on the repository's own compose files (plus their committed CPU overrides)
against the test's engine, under a project name of its own; `up()` is `up -d --wait`, so it returns once
every service is healthy, which for kvfuse means it answers queries (kvfuse/service/health.py).
`Phases` prints each phase's time as it ends and keeps them all for the summary.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from docker_engine import DockerEngine, run

REPO = Path(__file__).resolve().parents[2]
API_KEY = "deploy-test-key-0123456789"
REDIS_PASSWORD = "deploy-test-redis-password"
S3_SECRET_KEY = "deploy-test-s3-secret-key"  # the fleet's SeaweedFS (docker-compose.fleet.yml)
UP_TIMEOUT_S = 600


class Phases:
    """Wall time of each named phase, printed as it ends (to the terminal, past pytest's capture)."""

    capture = None  # pytest's capture manager, suspended around each line so it reaches the terminal

    def __init__(self) -> None:
        self.done: list[tuple[str, float, str]] = []

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        outcome = "failed"
        try:
            yield
            outcome = "ok"
        finally:
            took = time.monotonic() - start
            self.done.append((name, took, outcome))
            self.say(f"phase {name}: {took:.1f} s{'' if outcome == 'ok' else ' (failed)'}")

    @classmethod
    def say(cls, line: str) -> None:
        quiet = cls.capture.global_and_fixture_disabled() if cls.capture else contextlib.nullcontext()
        with quiet:
            print(f"[deploy] {time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)

    def summary(self) -> str:
        width = max((len(n) for n, _, _ in self.done), default=10)
        rows = [f"  {n:<{width}}  {t:7.1f} s  {o}" for n, t, o in self.done]
        return "\n".join(["deployment test phases:", *rows, f"  {'total':<{width}}  {sum(t for _, t, _ in self.done):7.1f} s"])

    def as_json(self) -> str:
        return json.dumps([{"phase": n, "seconds": round(t, 1), "outcome": o} for n, t, o in self.done], indent=1)


class Stack:
    """One compose project: the repository's `files`, the test's engine, `env` for interpolation."""

    def __init__(self, engine: DockerEngine, project: str, files: list[str], env: dict[str, str], port: int) -> None:
        self.engine = engine
        self.project = project
        self.files = files
        self.env = {**env, "KVFUSE_API_KEY": API_KEY, "KVFUSE_REDIS_PASSWORD": REDIS_PASSWORD,
                    "KVFUSE_S3_SECRET_KEY": S3_SECRET_KEY, "KVFUSE_PUBLISH": f"127.0.0.1:{port}"}
        self.url = f"http://127.0.0.1:{port}"

    def compose(self, *args: str, timeout: float = UP_TIMEOUT_S + 60, check: bool = True) -> subprocess.CompletedProcess:
        files = [a for f in self.files for a in ("-f", str(REPO / f))]
        return run("docker", "compose", "-p", self.project, "--project-directory", str(REPO), *files, *args,
                   env=self.env, timeout=timeout, check=check)

    def up(self, *extra: str) -> None:
        """`up -d --wait`: returns once every service is healthy; on failure, says what each one logged."""
        out = self.compose("up", "-d", "--wait", "--no-build", "--wait-timeout", str(UP_TIMEOUT_S), *extra,
                           check=False)
        if out.returncode != 0:
            raise AssertionError(f"compose up --wait failed:\n{out.stdout[-3000:]}\n{self.diagnosis()}")

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "-t", "10", timeout=300, check=False)

    def container(self, service: str, index: int = 1) -> str:
        return f"{self.project}-{service}-{index}"

    def health(self, service: str, index: int = 1) -> str:
        out = self.engine.docker("inspect", "--format", "{{.State.Health.Status}}", self.container(service, index),
                                 check=False)
        return out.stdout.strip()

    def logs(self, service: str, tail: int = 60) -> str:
        return self.compose("logs", "--no-color", "--tail", str(tail), service, check=False).stdout

    def diagnosis(self) -> str:
        """`compose ps` and each service's last log lines: what a failed phase prints."""
        ps = self.compose("ps", "-a", check=False).stdout
        services = self.compose("config", "--services", check=False).stdout.split()
        return ps + "".join(f"\n--- {s} ---\n{self.logs(s, 40)}" for s in services)

    def client(self, key: str | None = API_KEY, timeout: float = 300.0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)


def streamed_answer(client: httpx.Client, question: str, **body: object) -> tuple[str, list[tuple[str, object]]]:
    """A /v1/query answer over SSE: (its text from the token events, every event as (name, data))."""
    events: list[tuple[str, object]] = []
    event = "message"
    with client.stream("POST", "/v1/query", json={"query": question, "stream": True, **body}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
                events.append((event, data if data == "[DONE]" else json.loads(data)))
                event = "message"
                if data == "[DONE]":
                    break
    text = "".join(d["text"] for e, d in events if e == "token")
    return text, events
