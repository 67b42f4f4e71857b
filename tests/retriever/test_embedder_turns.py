"""The embedder's turns (kvfuse/retriever/embedder.py): ingestion's chunks embedded in the background, a
batch per turn, give the vectors they give in one call, and a question asked meanwhile is embedded before
the background call ends, not after it (the real default embedder, real threads)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvfuse.retriever import Embedder

TEXTS = [f"Paragraph {i} of a long report on harbour tides, ship traffic and the weather at sea, "
         f"with figure {i * 7} noted in its margin." for i in range(160)]


@pytest.fixture
def small_batches(embedder: Embedder):
    before = embedder.batch_size
    embedder.batch_size = 8
    yield embedder
    embedder.batch_size = before


def test_background_embedding_gives_the_vectors_of_one_call(small_batches: Embedder) -> None:
    texts = TEXTS[:16]
    np.testing.assert_allclose(small_batches.embed(texts, background=True), small_batches.embed(texts), atol=1e-5)


def test_a_question_goes_ahead_of_a_background_embedding(small_batches: Embedder) -> None:
    ends: dict[str, float] = {}

    def background() -> None:
        small_batches.embed(TEXTS, background=True)  # 20 turns of 8
        ends["background"] = time.monotonic()

    thread = threading.Thread(target=background)
    thread.start()
    deadline = time.monotonic() + 30
    while not small_batches._turns._held:  # the background call has taken its first turn
        assert time.monotonic() < deadline
        time.sleep(0.005)
    small_batches.embed(["Which harbour had the highest tide?"])
    ends["question"] = time.monotonic()
    thread.join()
    assert ends["question"] < ends["background"]
