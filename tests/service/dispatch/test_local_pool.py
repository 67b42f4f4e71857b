"""`server.workers: 2` without Redis: two local worker processes behind one API; concurrent queries are
spread over both (least loaded first) and each answer names the worker process that served it."""

from __future__ import annotations

import threading
import time

import pytest
from fleet_helpers import query
from service_helpers import API_KEY, ServerProcess, ingest, make_client

pytestmark = pytest.mark.slow


def test_two_local_workers_share_the_queries(tmp_path, essays3) -> None:
    srv = ServerProcess(tmp_path / "data", tmp_path / "server.log", KVFUSE_SERVER__API_KEYS=API_KEY,
                        KVFUSE_SERVER__WORKERS="2", KVFUSE_SERVER__MAX_RUNNING_REQUESTS="1",
                        KVFUSE_RETRIEVER__CHUNK_TOKENS="128", KVFUSE_RETRIEVER__TOP_K="2").start()
    try:
        with make_client(srv) as c:
            ingest(c, [{"id": name, "text": text} for name, text in essays3.items()])
            deadline = time.monotonic() + 300
            while len(c.get("/ready").json()["workers"]) < 2 and time.monotonic() < deadline:
                time.sleep(0.5)
            assert len(c.get("/ready").json()["workers"]) == 2
            out: list = []
            bodies = [{"query": q, "max_tokens": 8} for q in ("What is an NFT?", "What did Bronnie Ware list?",
                                                              "How does the author define power?", "What is a todo?")]
            threads = [threading.Thread(target=lambda b=b: out.append(query(c, b))) for b in bodies]
            for t in threads:
                t.start()
            for t in threads:
                t.join(600)
            names = {next(d for e, d in events if e == "done")["worker"] for _, events in out}
            assert len(out) == 4 and len(names) == 2, names
    finally:
        srv.stop()
