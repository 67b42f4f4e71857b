"""What a chunk's cache is computed after (`store.precompute_context`), and the context's identity.

A chunk cached alone starts a sequence: its first tokens become attention sinks and none of its tokens
has seen anything before it. Computed after a context instead (FusionRAG's offline stage, Wang et al.
2026, arXiv 2601.12904; APE's shared prefix), its K/V carry some of what a full prefill would put there;
only the chunk's own K/V are kept (`FusionEngine.precompute_after`), rotated back to positions 0..n-1, so
fusion recovers positions exactly as for a chunk cached alone. Modes:

- `none`: alone (no context).
- `document`: the chunk's preceding text in its own document, its last `budget` tokens.
- `neighbours`: its top-n most similar other chunks in the index (cosine of their embeddings), least
  similar first so the closest sits next to the chunk, the whole cut to its last `budget` tokens.
- `prefix`: the shared system prefix (the chat template up to the user's content).
- `sink`: the tokenizer's BOS token alone (CacheBlend's reference code computes each chunk after BOS): one
  shared attention sink, so no chunk grows its own at its first token, and nothing of any system prompt.
- `document_or_neighbours`: `document` where the chunk has text before it in its document, `neighbours`
  where it has none (a document's first chunk, and so every one-chunk document): `document` is the closer
  context on consecutive chunks, `neighbours` the only one a chunk with nothing before it can have
  (docs/results/prompt/README.md, "Chunks cached after their neighbours").

**The sequence's BOS first, for a tokenizer that adds one** (`sequence_start`, applied by `starting_with`
to every mode's contexts: ingestion, first use through the recorded context, and the fidelity bench).
Where the tokenizer puts a BOS before what it encodes and the served prompt starts with it (Gemma's,
Llama's), every context starts with that BOS: `none` becomes [BOS], `document`, `neighbours` and
`document_or_neighbours` get it before their tokens (the whole within the budget: BOS and the last
`budget - 1` tokens; at a budget of 0 or 1, BOS alone), and `prefix` and `sink`, which start with it
already, are kept as they are (never two). Why: in the served prompt every chunk comes after that BOS,
which is where the model keeps its attention sink. A chunk cached without it starts a sequence of its
own, so its first token becomes a sink and every later token's K/V is computed against it; after BOS the
chunk's K/V are the ones it has in the prompt, less only the text between (CacheBlend's reference code
likewise computes each chunk after BOS; docs/results/fidelity-gemma3/). A tokenizer that adds no BOS
(SmolLM2's, the default model's: its prompt starts with the chat template's first token, not an added
BOS) gets its contexts unchanged, so its chunk keys are unchanged.

The context is part of the chunk's identity: `kvblob.chunk_key(..., context_ids)` folds its tokens into
the chunk key (and the blob header records its hash), so a chunk computed after another context is
another cache: a store of a BOS-adding model (Gemma) ingested before the BOS was added misses every
chunk and computes it again. See docs/DESIGN.md, "Context-carrying chunk caches", for what happens to
stored caches when the neighbourhood changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

MODES = ("none", "document", "neighbours", "prefix", "sink", "document_or_neighbours")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown precompute context {mode!r}; choose from {', '.join(MODES)}")
    return mode


def sink_context(tokenizer: Any) -> list[int]:
    """`sink`: the BOS token, or the chat template's first token where the tokenizer has no BOS."""
    if tokenizer.bos_token_id is not None:
        return [int(tokenizer.bos_token_id)]
    from kvfuse.fusion.prompt import template_halves

    return list(tokenizer(template_halves(tokenizer, None)[0], add_special_tokens=False)["input_ids"][:1])


def sequence_start(tokenizer: Any) -> list[int]:
    """[BOS] when the tokenizer adds one and the served prompt starts with it, else [] (see the module's
    docstring): what every chunk context starts with."""
    from kvfuse.fusion.prompt import template_halves
    from kvfuse.fusion.prompt_style import adds_bos

    if not adds_bos(tokenizer):
        return []
    bos = int(tokenizer.bos_token_id)
    before = tokenizer(template_halves(tokenizer, None)[0], add_special_tokens=False)["input_ids"]
    return [bos] if list(before[:1]) == [bos] else []


def starting_with(start: Sequence[int], contexts: Sequence[Sequence[int]], budget: int) -> list[list[int]]:
    """Each context with `start` (`sequence_start`) first, within `budget` tokens: one that already starts
    with it as it is, any other `start` + its last `budget - len(start)` tokens (`start` alone at a
    smaller budget). No `start`: the contexts unchanged."""
    head = [int(t) for t in start]
    if not head:
        return [list(c) for c in contexts]
    keep = max(0, budget - len(head))
    return [list(c) if list(c[: len(head)]) == head else head + (list(c)[-keep:] if keep else [])
            for c in contexts]


def fill_empty(contexts: list[list[int]], fallback: Callable[[list[int]], list[list[int]]]) -> list[list[int]]:
    """`document_or_neighbours`: each non-empty context kept; the rows with none take `fallback(rows)`'s
    (one context per row, in order), so the fallback is only computed where it is used."""
    rows = [i for i, c in enumerate(contexts) if not c]
    if not rows:
        return contexts
    out = list(contexts)
    for i, ctx in zip(rows, fallback(rows), strict=True):
        out[i] = ctx
    return out


def document_contexts(chunks: Sequence[Sequence[int]], budget: int) -> list[list[int]]:
    """Chunks of one document in order: each one's context is the last `budget` tokens before it."""
    out, seen = [], []
    for c in chunks:
        out.append(list(seen[-budget:]) if budget > 0 else [])
        seen.extend(c)
    return out


def neighbour_order(vectors: Any, n: int) -> list[list[int]]:
    """For each row of `vectors` (unit-norm embeddings [N, d]), the indices of its n most similar other
    rows, least similar first. Ties go to the lower index (stable)."""
    import numpy as np

    vecs = np.asarray(vectors, dtype=np.float32)
    sims = vecs @ vecs.T
    np.fill_diagonal(sims, -np.inf)
    out = []
    for row in sims:
        order = np.argsort(-row, kind="stable")[: max(0, min(n, len(row) - 1))]
        out.append([int(j) for j in reversed(order)])
    return out


def joined(parts: Sequence[Sequence[int]], budget: int) -> list[int]:
    """Context pieces in order, concatenated and cut to their last `budget` tokens."""
    ctx = [t for part in parts for t in part]
    return ctx[-budget:] if budget > 0 else []


def neighbour_contexts(chunks: Sequence[Sequence[int]], vectors: Any, n: int, budget: int) -> list[list[int]]:
    """Each chunk's top-n neighbours' tokens, concatenated (least similar first), cut to the last
    `budget` tokens."""
    return [joined([chunks[j] for j in order], budget) for order in neighbour_order(vectors, n)]


def nearest_context(scored: Sequence[tuple[float, Sequence[int]]], n: int, budget: int) -> list[int]:
    """The context of one chunk from scored candidates (cosine, tokens): the n most similar, least similar
    first, joined and cut to `budget` tokens. Ties keep the candidates' order (what the service does
    with chunks found in the index; `neighbour_contexts` for the chunks of one set)."""
    best = sorted(range(len(scored)), key=lambda i: -scored[i][0])[: max(0, n)]
    return joined([scored[i][1] for i in reversed(best)], budget)


