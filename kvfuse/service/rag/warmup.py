"""Computing a first-use document's chunk KV ahead of its first query (`POST /v1/documents/{id}/precompute`,
and `POST /v1/collections/{name}/precompute` for every document of a collection): an operator's warm-up.

Under `store.precompute_at: first_use` a document is ready with none of its chunks' KV; a query computes
those it meets, after the context each one's record names (precompute_context.recorded_contexts). This
runs the same computation through the worker's ingestion path (PrecomputeJob, a piece per engine step,
so it shares the worker with running queries), for the chunks no store tier holds: the same keys, the
same KV as eager ingestion. The worker writes a chunk only while a document still refers to it (a
document deleted meanwhile leaves no orphan). A chunk whose context is not known (a record from before
contexts were recorded) is left to its first query. See docs/DESIGN.md, "KV when it pays".
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from kvfuse.service.dispatch.base import require_worker
from kvfuse.service.dispatch.job_book import precompute
from kvfuse.service.rag.precompute_context import recorded_contexts
from kvfuse.service.wire.protocol import PrecomputeJob

if TYPE_CHECKING:
    from kvfuse.config import Settings
    from kvfuse.service.metrics import Metrics
    from kvfuse.service.rag.corpus import Corpus


async def precompute_document(corpus: Corpus, dispatcher: Any, settings: Settings, metrics: Metrics,
                              rec: Any) -> dict[str, int]:
    """Compute and store the KV of a ready document's chunks that no tier holds; returns its counts:
    chunks, computed now, kv_chunks (holding KV after it)."""
    store = corpus.store

    def todo() -> tuple[list[list[int]], list[list[int]], list[str]]:
        ids, contexts = corpus.prompt_chunk_ids(rec), recorded_contexts(corpus, rec)
        rows = [i for i, key in enumerate(rec.chunk_keys) if contexts[i] is not None and not store.has_chunk(key)]
        return [ids[i] for i in rows], [contexts[i] for i in rows], [rec.chunk_keys[i] for i in rows]

    chunks, contexts, keys = await asyncio.to_thread(todo)
    computed, batch = 0, settings.server.precompute_batch_chunks
    if chunks:
        await require_worker(dispatcher, settings.server.worker_start_timeout_s)
    for i in range(0, len(chunks), batch):
        done = await precompute(dispatcher, PrecomputeJob(chunks[i : i + batch], contexts=contexts[i : i + batch],
                                                          referenced_only=True))
        if done.keys != keys[i : i + batch]:
            raise RuntimeError("the worker computed other chunk keys than the document's (model changed?)")
        computed += done.computed
        metrics.precomputed_chunks.inc(done.computed)
    stored = await asyncio.to_thread(store.stored_chunks, rec.chunk_keys)
    return {"chunks": len(rec.chunk_keys), "computed": computed, "kv_chunks": stored}
