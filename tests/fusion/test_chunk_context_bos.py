"""Every chunk context starts with the sequence's BOS for a tokenizer that adds one (kvfuse/fusion/
chunk_context.py, `sequence_start` and `starting_with`): exactly once, within the context budget, in every
mode; `prefix` and `sink`, which start with it already, as they are. The default model's tokenizer adds
none, so its contexts, and the chunk keys they go into, are what they were."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvfuse import kvblob
from kvfuse.fusion import FusionEngine
from kvfuse.fusion.chunk_context import (
    MODES,
    document_contexts,
    fill_empty,
    joined,
    neighbour_contexts,
    sequence_start,
    sink_context,
    starting_with,
)
from kvfuse.fusion.prompt import template_halves

BUDGET = 100


def test_starting_with_puts_the_start_first_once_within_the_budget() -> None:
    contexts = [[], [5, 6, 7, 8], [2, 9], [1], [2]]
    assert starting_with([2], contexts, 3) == [[2], [2, 7, 8], [2, 9], [2, 1], [2]]
    # a budget too small for more than the start: the start alone; one that starts with it is kept
    assert starting_with([2], contexts, 1) == [[2], [2], [2, 9], [2], [2]]
    assert starting_with([2], contexts, 0) == [[2], [2], [2, 9], [2], [2]]
    assert starting_with([], contexts, 3) == contexts


def _every_mode(tokenizer, chunks: list[list[int]]) -> dict[str, list[list[int]]]:
    """Each mode's contexts for one document's chunks, before the start (what the service's and the
    bench's builders compose)."""
    vectors = np.random.default_rng(0).normal(size=(len(chunks), 8))
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    prefix = tokenizer(template_halves(tokenizer, "You answer from the documents.")[0],
                       add_special_tokens=False)["input_ids"]
    out = {"none": [[] for _ in chunks], "document": document_contexts(chunks, BUDGET),
           "neighbours": neighbour_contexts(chunks, vectors, 2, BUDGET),
           "prefix": [joined([prefix], BUDGET) for _ in chunks], "sink": [sink_context(tokenizer) for _ in chunks]}
    out["document_or_neighbours"] = fill_empty(out["document"], lambda rows: [out["neighbours"][i] for i in rows])
    assert set(out) == set(MODES)
    return out


def _chunks(tokenizer, text: str) -> list[list[int]]:
    ids = tokenizer(text[:3000], add_special_tokens=False)["input_ids"]
    return [list(ids[i : i + 60]) for i in range(0, 240, 60)]


def test_a_bos_adding_tokenizer_starts_every_context_with_its_bos_once(gemma3_path: Path, essays) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gemma3_path)  # Gemma 3's: it adds a BOS, and its prompt starts with it
    bos = tok.bos_token_id
    assert tok("a")["input_ids"][0] == bos and sequence_start(tok) == [bos]
    chunks = _chunks(tok, dict(essays)["apple"])
    for mode, raw in _every_mode(tok, chunks).items():
        got = starting_with(sequence_start(tok), raw, BUDGET)
        for ctx, before in zip(got, raw, strict=True):
            assert ctx[0] == bos and ctx.count(bos) == 1 and len(ctx) <= BUDGET, (mode, ctx)
            if before[:1] == [bos]:  # prefix and sink start with it already: not doubled
                assert mode in ("prefix", "sink") and ctx == before
            else:
                assert ctx == [bos] + before[-(BUDGET - 1):] if before else ctx == [bos], mode
        if mode in ("none", "sink"):
            assert got == [[bos]] * len(chunks)


def test_the_default_models_contexts_and_chunk_keys_are_unchanged(engine: FusionEngine, essays) -> None:
    """SmolLM2's prompt starts with <|im_start|>, its BOS token, but from the chat template: its tokenizer
    adds none, so nothing is put before its contexts."""
    tok = engine.tokenizer
    assert engine.prompt_parts("q", None)[0][0] == tok.bos_token_id and tok("a")["input_ids"][0] != tok.bos_token_id
    assert sequence_start(tok) == []
    chunks = _chunks(tok, dict(essays)["apple"])
    fp = engine.fingerprint
    for mode, raw in _every_mode(tok, chunks).items():
        got = starting_with(sequence_start(tok), raw, BUDGET)
        assert got == raw, mode
        assert ([kvblob.chunk_key(fp, "float16", ids, ctx) for ids, ctx in zip(chunks, got, strict=True)]
                == [kvblob.chunk_key(fp, "float16", ids, ctx) for ids, ctx in zip(chunks, raw, strict=True)])
    # `none`: no context at all, so the key of a chunk cached alone, with no context section
    assert kvblob.chunk_key(fp, "float16", chunks[0], starting_with([], [[]], BUDGET)[0]) == \
        kvblob.chunk_key(fp, "float16", chunks[0])
