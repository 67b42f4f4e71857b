"""The flood of `kvfuse bench overload` (overload.py): client threads under the flood keys sending
ingestions, uploads and bodies past the limit without pause, the tally of every answer they got, the
bench's settings (`OverloadConfig`) and the wait for the accepted jobs' ends, which overload.py and
overload_costs.py both use."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

QUERY_KEY, FLOOD_KEYS, FAIR_KEY = "overload-query", ("overload-flood-a", "overload-flood-b"), "overload-fair"


@dataclass
class Tally:
    """Every flood answer as (kind, status, code), and the jobs the server accepted."""

    answers: Counter = field(default_factory=Counter)
    jobs: list[str] = field(default_factory=list)
    client_cpu_s: float = 0.0  # the flood threads' own CPU, each added as it ends
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_cpu(self, seconds: float) -> None:
        with self.lock:
            self.client_cpu_s += seconds

    def add(self, kind: str, resp: Any) -> None:
        body = _json(resp)
        code = (body.get("error") or {}).get("code", "") if resp.status_code >= 400 else ""
        ids = [d["job_id"] for d in body.get("documents", [body]) if d.get("job_id")] if resp.status_code == 202 else []
        with self.lock:
            self.answers[(kind, resp.status_code, code)] += 1
            self.jobs += ids

    def count(self, status: int | None = None, low: int = 0, high: int = 1000) -> int:
        return sum(n for (_, s, _), n in self.answers.items() if (s == status if status else low <= s < high))


def _json(resp: Any) -> dict:
    try:
        body = resp.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


class Flood:
    """`clients` threads of the first flood key sending, in turn and without pause, a batch of small
    documents, a small Markdown upload and a body past the limit; `uploaders` threads of the second the
    amplifying DOCX; the fair key one document a second. Every answer goes to the tally, and each
    thread's own CPU seconds to `tally.client_cpu_s`; nothing is waited for. `senders` ((key, kinds,
    threads), ...) replaces the two flood keys' threads, and `fair` drops the third key's (the refusal
    costs, overload_costs.py)."""

    def __init__(self, url: str, tally: Tally, *, clients: int, uploaders: int, batch: int, amplifier: bytes,
                 body_limit: int, senders: tuple[tuple[str, tuple[str, ...], int], ...] | None = None,
                 fair: bool = True) -> None:
        self.url, self.tally, self.batch = url, tally, batch
        self.amplifier, self.oversize = amplifier, b'{"text": "' + b"a" * (body_limit + 1) + b'"}'
        self._stop = threading.Event()
        self._n = 0
        ingest, upload = ("batch", "upload", "oversize"), ("amplifier",)
        senders = senders or ((FLOOD_KEYS[0], ingest, clients), (FLOOD_KEYS[1], upload, uploaders))
        self._threads = [threading.Thread(target=self._run, args=(key, kinds, i), daemon=True)
                         for key, kinds, n in senders for i in range(n)]
        if fair:
            self._threads.append(threading.Thread(target=self._fair, daemon=True))

    def _next(self) -> int:
        with self.tally.lock:
            self._n += 1
            return self._n

    def _send(self, c: Any, kind: str) -> None:
        n = self._next()
        if kind == "batch":
            docs = [{"id": f"flood-{n}-{i}", "text": f"Flood document {n}.{i}: the tide tables of harbour {i}."}
                    for i in range(self.batch)]
            resp = c.post("/v1/documents", json={"documents": docs})
        elif kind == "upload":
            resp = c.post("/v1/documents", files={"file": (f"note-{n}.md", f"# Note {n}\n\nA small upload.".encode())},
                          data={"id": f"upload-{n}"})
        elif kind == "amplifier":
            resp = c.post("/v1/documents", files={"file": ("wide.docx", self.amplifier)}, data={"id": f"wide-{n}"})
        else:
            resp = c.post("/v1/documents", content=self.oversize, headers={"Content-Type": "application/json"})
        self.tally.add(kind, resp)

    def _run(self, key: str, kinds: tuple[str, ...], offset: int) -> None:
        import httpx

        _low_priority()
        with httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as c:
            i = offset
            while not self._stop.is_set():
                self._send(c, kinds[i % len(kinds)])
                i += 1
        self.tally.add_cpu(time.thread_time())

    def _fair(self) -> None:
        import httpx

        with httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {FAIR_KEY}"}, timeout=120) as c:
            while not self._stop.wait(1.0):
                n = self._next()
                self.tally.add("fair", c.post("/v1/documents", json={"id": f"fair-{n}", "text": f"Fair note {n}."}))
        self.tally.add_cpu(time.thread_time())

    def __enter__(self) -> Flood:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)


def _low_priority() -> None:
    """This flood thread at nice 10: a real flood's clients spend their CPU on other machines, and on one
    machine their own work would otherwise be counted against the server's."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except OSError:
        pass


@dataclass
class OverloadConfig:
    url: str
    api_pid: int  # the API process (`kvfuse serve`): its RSS is read from /proc
    server: dict[str, Any]  # its server settings: the bounds, and the RSS bound they set
    rounds: int = 4  # alternating blocks of each kind
    per_block: int = 4  # queries per block
    clients: int = 1  # flood threads of the ingesting key
    uploaders: int = 4  # flood threads of the uploading key: more than the parse processes and waiters
    batch: int = 2  # documents per flood batch
    burst: int = 48  # requests at once after the blocks
    jobs_timeout_s: float = 600.0
    cost_window_s: float = 5.0  # each window of the refusal costs (overload_costs.py); 0: not measured


def wait_jobs(url: str, job_ids: list[str], timeout_s: float) -> Counter:
    """Each job's final status (or where it stood at the deadline)."""
    import httpx

    statuses: Counter = Counter()
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {FLOOD_KEYS[0]}"}, timeout=60) as c:
        for job_id in job_ids:
            while True:
                status = c.get(f"/v1/jobs/{job_id}").json().get("status")
                if status in ("ready", "failed", "cancelled") or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            statuses[status] += 1
    return statuses
