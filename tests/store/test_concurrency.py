"""Two reader processes read the LMDB store while this process writes to it, growing the map from a
tiny initial size meanwhile (so the readers must adopt the resized map)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from store_kvdata import make_blob

from kvfuse.store import DocumentRecord, KVStore

N_CHUNKS, TOKENS = 24, 64  # 24 x 1.5 MB (fp16) = 35 MB through a map that starts at 1 MB

READER = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
import torch
from store_kvdata import make_blob, make_kv
from kvfuse.config import load_settings
from kvfuse.store import KVStore

data_dir, stop_file, n, tokens = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
keys = [make_blob(i, tokens=tokens)[0] for i in range(n)]
expected = [make_kv(i, tokens)[0].half() for i in range(n)]
settings = load_settings(data_dir=data_dir, redis_url="", store={"hot_tier_mb": 0, "lmdb_map_size_mb": 1})
store = KVStore.open(settings, readonly=True)
print("ready", flush=True)
reads = hits = passes = 0
seen = set()
while True:
    done = os.path.exists(stop_file)  # one more full pass after the writer finished
    for i, key in enumerate(keys):
        entry = store.load_chunk(key)
        reads += 1
        if entry is not None:
            assert torch.equal(entry[0], expected[i]), f"chunk {i} read back wrong"
            hits += 1
            seen.add(i)
    passes += 1
    if done:
        break
docs = store.list_documents(limit=1000)[1]
print(json.dumps({"reads": reads, "hits": hits, "seen": len(seen), "passes": passes, "docs": docs}), flush=True)
"""


@pytest.mark.slow
def test_two_reader_processes_while_one_writes(settings_factory, tmp_path: Path) -> None:
    settings = settings_factory(redis_url="", store={"lmdb_map_size_mb": 1})
    stop = tmp_path / "writer-done"
    blobs = [make_blob(i, tokens=TOKENS)[:2] for i in range(N_CHUNKS)]
    with KVStore.open(settings) as writer:  # creates the environment the readers open
        readers = [
            subprocess.Popen(
                [sys.executable, "-c", READER, str(Path(__file__).parent), str(settings.data_dir), str(stop),
                 str(N_CHUNKS), str(TOKENS)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            for _ in range(2)
        ]
        try:
            for r in readers:
                assert r.stdout.readline().strip() == "ready", r.stderr.read()
            for i, (key, blob) in enumerate(blobs):
                writer.put_chunk(key, blob)
                writer.put_document(DocumentRecord(id=f"d{i}", status="ready", chunk_keys=[key]), text=str(i))
                time.sleep(0.02)
            grown = writer.stats()["lmdb_map_bytes"]
            stop.touch()
            results = []
            for r in readers:
                out, err = r.communicate(timeout=120)
                assert r.returncode == 0, err
                results.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for r in readers:
                if r.poll() is None:
                    r.kill()
    assert grown > 1 << 20
    for res in results:
        assert res["seen"] == N_CHUNKS and res["docs"] == N_CHUNKS
        assert res["hits"] > N_CHUNKS  # the last pass alone hits each chunk once: the rest came during writes
