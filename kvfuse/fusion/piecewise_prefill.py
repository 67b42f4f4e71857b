"""A full prefill run a piece of prompt rows at a time: chunked prefill (Sarathi-Serve, vLLM's
`enable_chunked_prefill`), for work that must yield the engine often and never hold it long.

`FusionEngine.fuse_steps` pauses after every decoder layer, but each layer runs every row of the prompt,
so its smallest unit of work grows with the prompt. Here the prompt is cut into pieces of `piece_rows`
consecutive positions; each piece goes through every layer, writing its K/V into the cache by position
and attending causally over the keys before it (lower-right causal, the contiguous-rows case of
kvfuse/fusion/model/attention.py), exactly as the rows of one whole prefill do. The result is the same cache
and the same last-row logits as `fuse_steps` with method `vanilla`, up to the float error of a different
summation order (tests/fusion/test_piecewise_prefill.py pins it).

Used by the worker's shadow checks (kvfuse/service/worker/shadow.py): a check's prefill runs in the
worker's idle time, and a live request that arrives meanwhile waits for at most one piece.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import torch

from kvfuse.fusion.engine.kv_memory import FusedCache
from kvfuse.fusion.types import FusedPrefill


def prefill_steps(engine: Any, prompt: Sequence[Sequence[int]], piece_rows: int, *, max_tokens: int = 0
                  ) -> Generator[int, None, FusedPrefill]:
    """The full prefill of `prompt` (prefix, chunks..., question: token id lists), `piece_rows` positions
    at a time. Yields the rows each decoder layer ran (the unit `fuse_steps` yields; at most
    `piece_rows`) and returns a FusedPrefill whose cache has room for `max_tokens` more tokens."""
    if piece_rows < 1:
        raise ValueError(f"piece_rows must be >= 1, got {piece_rows}")
    prefix, *chunks, question = [list(p) for p in prompt]
    if not question:
        raise ValueError("the question must not be empty")
    ids = [t for part in prompt for t in part]
    engine.check_context(len(ids), max_tokens)
    tf = engine.tf
    cache = FusedCache(engine.num_layers, engine.num_kv_heads, engine.head_dim, len(ids) + max_tokens,
                       engine.dtype, engine.device)
    h = None
    for start in range(0, len(ids), piece_rows):
        stop = min(start + piece_rows, len(ids))
        with torch.inference_mode():
            rows = engine.rows(torch.arange(start, stop, device=engine.device))
            h = tf.embed(torch.tensor(ids[start:stop], dtype=torch.long, device=engine.device))
        for layer in range(tf.num_layers):
            # Transformer.run: at the last layer every row writes its K/V, only the final row runs on.
            with torch.inference_mode():
                h = tf.run(cache, h, rows, range(layer, layer + 1))
            yield rows.count
    cache.length = len(ids)
    with torch.inference_mode():
        logits = tf.logits(h[:, -1])[0]
    context = sum(len(c) for c in chunks)
    stats = {"prefix_tokens": len(prefix), "context_tokens": context, "question_tokens": len(question),
             "recomputed_tokens": context, "full_layers": engine.num_layers}
    selected = torch.arange(len(prefix), len(prefix) + context, device=engine.device)
    return FusedPrefill(cache, logits, selected, stats, {})
