"""Helpers for HTTP tests. A real kvfuse server: `kvfuse serve` in a subprocess on a free loopback port, with a temp
data dir, the real worker process and the default model. One server per test module (startup loads the
LLM in the worker and the embedder in the API process)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from redis_server import free_port

from kvfuse.service.probe import wait_ready

REPO = Path(__file__).resolve().parents[2]
# Same model cache as tests/conftest.py (a fresh cache would re-convert the GGUF per server).
MODEL_CACHE = Path(os.environ.get("KVFUSE_TEST_MODEL_CACHE", REPO / "data" / "models"))
API_KEY = "test-key-0123456789"
START_TIMEOUT_S = 300  # the worker loads the LLM; on a busy 2-core machine this can take a while
READY_POLL_S = 0.1  # a server is started some hundred times in the suite: each ready noticed sooner


class KvfuseProcess:
    """`python -m kvfuse.cli ...` with its own data dir and log, settings passed as KVFUSE_* environment
    variables (the test model cache, info logging, no config file)."""

    def __init__(self, data_dir: Path, log_path: Path, *, new_session: bool = False, **env: str) -> None:
        self.data_dir = data_dir
        self.log_path = log_path
        self.new_session = new_session  # its own process group, so kill_group() takes its children too
        self.env = env
        self.proc: subprocess.Popen | None = None

    def _spawn(self, args: list[str], **extra: str) -> None:
        env = {**os.environ, "KVFUSE_DATA_DIR": str(self.data_dir), "KVFUSE_MODEL_CACHE_DIR": str(MODEL_CACHE),
               "KVFUSE_LOG_LEVEL": "info", **extra, **self.env}
        env.pop("KVFUSE_CONFIG", None)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen([sys.executable, "-m", "kvfuse.cli", *args], cwd=REPO, env=env,
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=self.new_session)
        log.close()

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""


class ServerProcess(KvfuseProcess):
    """`python -m kvfuse.cli serve` on a free loopback port."""

    def __init__(self, data_dir: Path, log_path: Path, *, new_session: bool = False, **env: str) -> None:
        super().__init__(data_dir, log_path, new_session=new_session, **env)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait: bool = True) -> ServerProcess:
        self.port = free_port()
        self._spawn(["serve"], KVFUSE_SERVER__PORT=str(self.port), KVFUSE_SERVER__HOST="127.0.0.1")
        if wait:
            self.wait_ready()
        return self

    def kill_group(self) -> None:
        """SIGKILL the API process and its worker at once (a power cut, not a stop): needs new_session."""
        assert self.proc is not None and self.new_session
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        if wait_ready(self.url, timeout, alive=lambda: self.proc is None or self.proc.poll() is None,
                      every=READY_POLL_S):
            return
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log_tail()}")


class Holder:
    """A test module's server; a restart test may replace it."""

    server: ServerProcess


@contextmanager
def serving(root: Path, env: dict[str, str], essays: dict[str, str] | None = None,
            setup: Callable[[httpx.Client], None] | None = None) -> Iterator[Holder]:
    """A server on a fresh data dir under `root`, with `essays` ingested (each ready, its name as id and
    topic) and `setup` run, stopped at the end (a module fixture yields what this yields)."""
    h = Holder()
    h.server = ServerProcess(root / "data", root / "server.log", **env)
    try:
        h.server.start()  # inside the try: a server that never got ready is stopped too, not left running
        if essays or setup:
            with make_client(h.server) as c:
                if essays:
                    body = ingest(c, [{"id": name, "text": text, "metadata": {"topic": name}}
                                      for name, text in essays.items()])
                    assert [d["status"] for d in body["documents"]] == ["ready"] * len(essays), body
                if setup is not None:
                    setup(c)
        yield h
    finally:
        h.server.stop()


def make_client(server: ServerProcess, key: str | None = API_KEY, timeout: float = 180.0) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=timeout)


def sse_events(resp: httpx.Response) -> Iterator[tuple[str | None, str]]:
    """(event name or None, data) per server-sent event of a streaming response."""
    event = None
    for line in resp.iter_lines():
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            yield event, line[6:]
            event = None


def read_stream(resp: httpx.Response, on_event=None) -> list[tuple[str | None, object]]:
    """Every event of a /v1/query stream, data parsed (the final `[DONE]` kept as a string); each is
    also passed to `on_event` as it arrives, if given."""
    out: list[tuple[str | None, object]] = []
    for event, data in sse_events(resp):
        out.append((event, data if data == "[DONE]" else json.loads(data)))
        if on_event is not None:
            on_event(*out[-1])
        if data == "[DONE]":
            break
    return out


def metric(client: httpx.Client, name: str) -> float:
    """The value of an unlabelled Prometheus sample (0 if absent)."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def ingest(client: httpx.Client, docs: list[dict]) -> dict:
    resp = client.post("/v1/documents?wait=true", json={"documents": docs})
    assert resp.status_code in (200, 201), resp.text
    return resp.json()


def wait_job(client: httpx.Client, job_id: str, timeout: float = 300.0) -> dict:
    """Poll a job until it ends; its last JSON."""
    deadline = time.monotonic() + timeout
    while True:
        resp = client.get(f"/v1/jobs/{job_id}")
        assert resp.status_code == 200, resp.text
        job = resp.json()
        if job["status"] not in ("pending", "processing"):
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.2)


def until(predicate, timeout: float, what: str, every: float = 0.25):
    """Poll `predicate` until it returns something true, which is returned; fail with `what` after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, what
        time.sleep(every)
    return value


def wait_progress(client: httpx.Client, job_id: str, chunks: int, timeout: float = 300.0) -> dict:
    """Poll a running job until it has precomputed `chunks` chunks; its JSON then."""
    deadline = time.monotonic() + timeout
    while (j := client.get(f"/v1/jobs/{job_id}").json())["progress"]["chunks_done"] < chunks:
        assert j["status"] in ("pending", "processing") and time.monotonic() < deadline, j
        time.sleep(0.05)
    return j


def worker_pid(client: httpx.Client) -> int | None:
    """The pid of the ready worker (GET /health with a valid key), None while there is none."""
    worker = client.get("/health").json().get("worker") or {}
    return worker.get("pid") if worker.get("ready") else None


def store_check(data_dir: Path, *args: str) -> dict:
    """`kvfuse store check --json [args]` on a data dir (the server stopped), as a separate process."""
    env = {**os.environ, "KVFUSE_DATA_DIR": str(data_dir), "KVFUSE_REDIS_URL": "", "KVFUSE_STORE__ORPHAN_GRACE_S": "0"}
    env.pop("KVFUSE_CONFIG", None)
    out = subprocess.run([sys.executable, "-m", "kvfuse.cli", "store", "check", "--json", *args], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout, out.stderr
    return json.loads(out.stdout)


def retuned_default_model(dest: Path) -> Path:
    """A copy of the default LLM with its final norm's weights scaled by 1.001: another model of the
    same shape, config and vocabulary (what a fine-tune looks like to the store), in float32 (a bfloat16
    copy would serve as slowly as CPUs without bfloat16 units run it)."""
    from safetensors.torch import load_file, save_file

    from kvfuse.model_files import DEFAULT, resolve_llm

    src = Path(resolve_llm(DEFAULT, MODEL_CACHE))
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dest / f.name).write_bytes(f.read_bytes())
    weights = load_file(src / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.001
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def version_text(essays: list[tuple[str, str]], doc: int, version: int) -> str:
    """A distinct text per (document, version), a few chunks long."""
    _, text = essays[(doc * 7 + version) % len(essays)]
    return f"Version {version} of document {doc}.\n\n" + text[: 700 + 250 * doc]


class Ledger:
    """What the client was promised: per document, the versions sent in order, and which got a 202."""

    def __init__(self) -> None:
        self.sent: dict[str, list[tuple[str, bool]]] = {}  # doc id -> [(text, acknowledged)]
        self.jobs: list[str] = []  # acknowledged job ids
        self.batches = 0  # batches acknowledged
        self.lock = threading.Lock()

    def allowed(self, doc_id: str) -> set[str]:
        """Content hashes the document may have: its last acknowledged version or any later one."""
        versions = self.sent.get(doc_id, [])
        last_ack = max((i for i, (_, ack) in enumerate(versions) if ack), default=-1)
        return {sha(t) for t, _ in versions[max(last_ack, 0):]}
