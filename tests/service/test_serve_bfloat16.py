"""`kvfuse serve` with `model.dtype: bfloat16` (what the committed docker-compose files run on a GPU) turns
ready on the CPU: the worker's load check of the default model passes within the tolerance bfloat16's
rounding allows (kvfuse/fusion/model/check.py, `tolerance`), and a query is answered."""

from __future__ import annotations

from pathlib import Path

import pytest
from service_helpers import API_KEY, MODEL_CACHE, ServerProcess, make_client

from kvfuse.model_files import DEFAULT, resolve_llm

pytestmark = pytest.mark.slow


def test_serve_in_bfloat16_passes_its_load_check_and_turns_ready(tmp_path: Path) -> None:
    # The default model by its path, with a models dir of this test's own: no pass remembered from another
    # run, so the worker runs the check; one torch thread (the 16-bit CPU kernels on a busy 2-core machine).
    server = ServerProcess(tmp_path / "data", tmp_path / "server.log", KVFUSE_MODEL__DTYPE="bfloat16",
                           KVFUSE_MODEL__LLM=resolve_llm(DEFAULT, MODEL_CACHE),
                           KVFUSE_MODEL_CACHE_DIR=str(tmp_path / "models"), KVFUSE_SERVER__API_KEYS=API_KEY,
                           KVFUSE_SERVER__WORKER_START_ATTEMPTS="1", KVFUSE_MODEL__THREADS="1")
    try:
        server.start()
        log = server.log_tail(400)
        assert "model check passed" in log and "model check skipped" not in log, log
        assert list((tmp_path / "models" / "checks").glob("*.json")), "the pass is remembered"
        with make_client(server) as c:
            ready = c.get("/ready")
            assert ready.status_code == 200, ready.text
            c.post("/v1/documents?wait=true", json={"id": "d", "text": "The archive of the harbour town flooded in "
                                                    "the year of the long winter."}).raise_for_status()
            resp = c.post("/v1/query", json={"query": "What flooded?", "max_tokens": 8})
            assert resp.status_code == 200, resp.text
            assert resp.json()["answer"].strip(), resp.text
    finally:
        server.stop()
