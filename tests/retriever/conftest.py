"""Fixtures of the retriever tests: the default LLM's tokenizer (never the model), the default embedder, and
every essay chunked at 512 tokens and embedded once per session (the slow part: all tests share it)."""

from __future__ import annotations

import numpy as np
import pytest

from kvfuse.config import RetrieverSettings
from kvfuse.retriever import Chunk, Chunker, Embedder


@pytest.fixture(scope="session")
def llm_tokenizer(default_llm_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_llm_path)


@pytest.fixture(scope="session")
def embedder(default_embedder_path: str) -> Embedder:
    return Embedder(default_embedder_path)


@pytest.fixture(scope="session")
def essay_chunks(essays, llm_tokenizer) -> dict[str, list[Chunk]]:
    chunker = Chunker(llm_tokenizer, RetrieverSettings().chunk_tokens)
    return {name: chunker.chunk(text) for name, text in essays}


@pytest.fixture(scope="session")
def essay_vectors(essay_chunks, embedder) -> dict[str, np.ndarray]:
    """Every chunk of every essay embedded in one call (one batched pass)."""
    names = list(essay_chunks)
    texts = [c.text for n in names for c in essay_chunks[n]]
    vecs = embedder.embed(texts)
    out, i = {}, 0
    for n in names:
        k = len(essay_chunks[n])
        out[n] = vecs[i : i + k]
        i += k
    return out


@pytest.fixture(scope="session")
def unit_vectors():
    """make(n, dim, seed): random L2-normalized float32 vectors, for tests of index mechanics, which do
    not depend on what the vectors mean (retrieval quality is tested on real essay embeddings)."""

    def make(n: int, dim: int = 32, seed: int = 0) -> np.ndarray:
        rng = np.random.default_rng(seed)
        v = rng.standard_normal((n, dim)).astype(np.float32)
        return v / np.linalg.norm(v, axis=1, keepdims=True)

    return make
