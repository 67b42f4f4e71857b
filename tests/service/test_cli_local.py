"""`kvfuse ingest --local`: no server running; the command runs the service on the data dir itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from service_helpers import MODEL_CACHE, REPO

pytestmark = pytest.mark.slow


def test_ingest_local_writes_the_data_dir_with_the_redis_index(tmp_path: Path, redis_url: str,
                                                                redis_namespace: str) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "owls.txt").write_text("Barn owls hunt at night and swallow mice whole.", encoding="utf-8")
    (docs / "tea.md").write_text("Green tea is steamed or pan-fired soon after picking.", encoding="utf-8")
    data = tmp_path / "data"
    env = {**os.environ, "KVFUSE_DATA_DIR": str(data), "KVFUSE_MODEL_CACHE_DIR": str(MODEL_CACHE),
           "KVFUSE_SERVER__API_KEYS": "local-key", "KVFUSE_RETRIEVER__CHUNK_TOKENS": "64",
           "KVFUSE_REDIS_URL": redis_url, "KVFUSE_STORE__REDIS_NAMESPACE": redis_namespace}
    env.pop("KVFUSE_CONFIG", None)
    out = subprocess.run([sys.executable, "-m", "kvfuse.cli", "ingest", str(docs), "--local"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2 of 2 documents ingested" in out.stdout

    from kvfuse.config import load_settings
    from kvfuse.retriever import VectorIndex
    from kvfuse.store import KVStore

    settings = load_settings(data_dir=data, model_cache_dir=MODEL_CACHE, redis_url=redis_url,
                             store={"redis_namespace": redis_namespace})
    with KVStore.open(settings, readonly=True) as store:
        assert store.stats()["index"] == "redis"
        for doc_id in ("owls", "tea"):
            rec = store.get_document(doc_id)
            assert rec is not None and rec.status == "ready" and rec.kv_bytes > 0
            assert all(store.has_chunk(k) for k in rec.chunk_keys)
    index = VectorIndex.open(settings.faiss_dir, 384, settings.retriever)
    assert index.document_ids() == {"owls", "tea"}
