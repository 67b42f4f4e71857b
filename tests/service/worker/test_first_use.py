"""A chunk in no tier, computed within a query after the context its record names (kvfuse/service/worker/
chunk_kv.py), in the whole worker (WorkerCore) with the real default model and a real LMDB store:

- chunks precomputed as eager ingestion does (each after its document's text before it), their blobs then
  deleted from the store (what an eviction leaves), a query over them: each is computed after its
  context, batched with the query's other cold chunks, written back, and the blob it writes is eager
  ingestion's, byte for byte; the answer is eager's, token for token; the next query reads them.
- a computed chunk no document refers to is not written (it would be an orphan); one whose context is not
  known (an old record) is computed alone, counted as a miss, and not written under its context's key.
"""

from __future__ import annotations

import pytest
import torch
from test_scheduler_worker import MODEL_CACHE, essay_chunks, query

from kvfuse.config import load_settings
from kvfuse.fusion.chunk_context import document_contexts
from kvfuse.service.wire import protocol as P
from kvfuse.service.worker.core import WorkerCore
from kvfuse.store.records import DocumentRecord

pytestmark = pytest.mark.slow


def _worker(tmp_path_factory: pytest.TempPathFactory, name: str, **store: object):
    """A worker over a data dir of its own (`store`: its store settings), recording what it sends."""
    root = tmp_path_factory.mktemp(name)
    settings = load_settings(data_dir=root / "data", model_cache_dir=MODEL_CACHE, log_level="warning",
                             model={"max_context_tokens": 4096, "threads": 1}, store=store,
                             server={"max_running_requests": 2, "kv_budget_tokens": 3000})
    sent: list = []
    w = WorkerCore(settings, sent.append)
    w.sent = sent
    return w


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory):
    w = _worker(tmp_path_factory, "first-use")
    yield w
    w.store.close()


def drive(w: WorkerCore, msg) -> list:
    w.sent.clear()
    assert w.receive(msg)
    while w.has_work:
        w.step()
    return list(w.sent)


def blobs(w: WorkerCore, keys: list[str]) -> list[bytes | None]:
    with w.store.env.read() as txn:
        return [None if (b := txn.get(k.encode(), db=w.store.env.db("chunks"))) is None else bytes(b) for k in keys]


def ask(w: WorkerCore, chunks, keys, contexts, job_id: int, cold_chunks: str = "compute", method: str = "anchor",
        sent: list | None = None) -> P.Result:
    """One query over the chunks, run until the worker has nothing left to do (a deferred computation
    included); `sent` gets every message it sent."""
    job = query(chunks, list(range(len(chunks))), max_tokens=6, method=method)
    job.fusion["cold_chunks"] = cold_chunks
    job.chunks = [P.ChunkRef(k, ids, 1.0, context=ctx) for k, ids, ctx in zip(keys, chunks, contexts, strict=True)]
    job.job_id = job_id
    out = drive(w, job)
    if sent is not None:
        sent += out
    results = [m for m in out if isinstance(m, P.Result)]
    assert len(results) == 1, out
    return results[0]


def evict(w: WorkerCore, keys: list[str]) -> None:
    for key in keys:  # evicted: gone from every tier, still referenced by its document
        assert w.store.blobs.remove(key)
        w.store.chunks.evict([key])


def test_an_evicted_chunk_is_computed_after_its_context_as_ingestion_did(worker, essays, default_llm_path) -> None:
    w = worker
    chunks = essay_chunks(essays, default_llm_path, 4)[1:]  # three chunks, each with text before it
    doc = essay_chunks(essays, default_llm_path, 4)
    contexts = document_contexts(doc, 96)[1:]
    assert all(contexts)
    done = next(m for m in drive(w, P.PrecomputeJob(chunks=chunks, contexts=contexts, job_id=1)) if isinstance(m, P.Done))
    keys = done.keys
    w.store.put_document(DocumentRecord(id="apple", status="ready", chunk_keys=keys,
                                        chunk_tokens=[len(c) for c in chunks]), text="apple")
    eager = blobs(w, keys)
    assert all(eager)
    warm = ask(w, chunks, keys, contexts, 10)
    assert warm.usage["chunks_computed"] == 0 and warm.usage["chunks_read"] == 3

    evict(w, keys)
    assert blobs(w, keys) == [None] * 3
    cold = ask(w, chunks, keys, contexts, 11)
    assert cold.usage["chunks_computed"] == 3 and cold.usage["chunks_read"] == 0 and cold.rebuilt_chunks == 3
    assert cold.kv_reads.get("source:recompute:first_use") == 3, cold.kv_reads
    assert cold.timings["kv_compute_s"] > 0
    assert blobs(w, keys) == eager  # written back, eager ingestion's blob byte for byte
    assert cold.text == warm.text  # the answer over them is the answer over the stored chunks
    again = ask(w, chunks, keys, contexts, 12)
    assert again.usage["chunks_computed"] == 0 and again.text == warm.text

    # A chunk no document refers to is computed for the query but not kept; one whose context is not
    # known is computed alone (a miss) and not kept under its context's key.
    other = [doc[0], chunks[0]]
    okeys = [w.kv.key_of(doc[0], chunks[0][:8]), w.kv.key_of(chunks[0], doc[0][:5])]
    res = ask(w, other, okeys, [chunks[0][:8], None], 13)
    assert res.usage["chunks_computed"] == 2
    assert res.kv_reads.get("source:recompute:first_use") == 1 and res.kv_reads.get("source:recompute:miss") == 1
    assert blobs(w, okeys) == [None, None]



def test_a_query_whose_chunks_are_cold_is_answered_by_a_full_prefill_and_computes_them_after(
        worker, essays, default_llm_path) -> None:
    """`fusion.cold_chunks: auto`: three cold chunks, each after a context as long as itself, cost more to
    compute than the whole prompt's full prefill, so the query is vanilla's (its Plan says so; its answer is
    vanilla's token for token), and the worker computes them after it at ingestion's share: eager's blobs
    byte for byte, which the next query reads. One cold chunk of three costs less than the full prefill:
    computed within the query, as `compute` does."""
    w = worker
    doc = essay_chunks(essays, default_llm_path, 5)
    chunks, contexts = doc[2:], document_contexts(doc, 96)[2:]
    done = next(m for m in drive(w, P.PrecomputeJob(chunks=chunks, contexts=contexts, job_id=30)) if isinstance(m, P.Done))
    keys = done.keys
    w.store.put_document(DocumentRecord(id="apple-auto", status="ready", chunk_keys=keys,
                                        chunk_tokens=[len(c) for c in chunks]), text="apple")
    eager = blobs(w, keys)
    vanilla = ask(w, chunks, keys, contexts, 31, method="vanilla")
    evict(w, keys)
    sent: list = []
    cold = ask(w, chunks, keys, contexts, 32, cold_chunks="auto", sent=sent)
    plan = next(m for m in sent if isinstance(m, P.Plan))
    assert plan.method == "vanilla" and cold.usage["chunks_deferred"] == 3 and "chunks_computed" not in cold.usage
    assert cold.rebuilt_chunks == 3
    assert cold.kv_reads.get("source:recompute:deferred") == 3, cold.kv_reads
    assert cold.text == vanilla.text
    assert blobs(w, keys) == eager  # computed after the answer (drive ran the worker dry), as ingestion did
    warm = ask(w, chunks, keys, contexts, 33, cold_chunks="auto")
    assert warm.usage["chunks_read"] == 3 and warm.usage["chunks_computed"] == 0 and "chunks_deferred" not in warm.usage

    evict(w, keys[:1])
    sent.clear()
    one = ask(w, chunks, keys, contexts, 34, cold_chunks="auto", sent=sent)
    assert next(m for m in sent if isinstance(m, P.Plan)).method is None
    assert one.usage["chunks_computed"] == 1 and one.text == warm.text and blobs(w, keys) == eager


def test_chunks_after_the_sequence_bos_are_computed_on_first_use_as_eager_ingestion_did(
        worker, essays, default_llm_path) -> None:
    """The contexts a BOS-adding tokenizer's chunks get (chunk_context.starting_with: the BOS alone for the
    first chunk, the BOS and the text before it for the others; the default model's BOS stands in for it):
    evicted and computed within a query, each blob is eager ingestion's, byte for byte."""
    from kvfuse.fusion.chunk_context import starting_with

    w = worker
    doc = essay_chunks(essays, default_llm_path, 4)
    bos = [int(w.engine.tokenizer.bos_token_id)]
    contexts = starting_with(bos, document_contexts(doc, 96), 96)
    assert contexts[0] == bos and all(c[0] == bos[0] and len(c) <= 96 for c in contexts)
    done = next(m for m in drive(w, P.PrecomputeJob(chunks=doc, contexts=contexts, job_id=40)) if isinstance(m, P.Done))
    keys = done.keys
    assert keys == [w.kv.key_of(ids, ctx) for ids, ctx in zip(doc, contexts, strict=True)]
    assert keys[0] != w.kv.key_of(doc[0])  # after the BOS is another cache than alone
    w.store.put_document(DocumentRecord(id="apple-bos", status="ready", chunk_keys=keys,
                                        chunk_tokens=[len(c) for c in doc]), text="apple")
    eager = blobs(w, keys)
    assert all(eager)
    warm = ask(w, doc, keys, contexts, 41)
    evict(w, keys)
    cold = ask(w, doc, keys, contexts, 42)
    assert cold.usage["chunks_computed"] == 4 and cold.kv_reads.get("source:recompute:first_use") == 4
    assert blobs(w, keys) == eager and cold.text == warm.text


@pytest.fixture(scope="module")
def runs_worker(tmp_path_factory: pytest.TempPathFactory):
    w = _worker(tmp_path_factory, "first-use-runs", precompute_runs=True)
    yield w
    w.store.close()


def test_with_precompute_runs_a_documents_cold_chunks_share_one_prefill_equal_to_rounding(
        runs_worker, essays, default_llm_path) -> None:
    """`store.precompute_runs`: consecutive cold chunks whose contexts reach back to their document's
    start are one run (chunk_kv.context_runs), one prefill of the document's span. Their KV is the
    separate prefills' to fp32 rounding, and their int8 blobs within one quantization step of those
    (not byte for byte: the bound is what the setting promises); the chunks are written back, and the
    next query reads them and answers as the cold one did."""
    from kvfuse import kvblob
    from kvfuse.service.worker.chunk_kv import context_runs

    w = runs_worker
    doc = essay_chunks(essays, default_llm_path, 4)
    chunks, contexts = doc[1:], document_contexts(doc, 1000)[1:]
    assert context_runs(chunks, contexts) == [[0, 1, 2]]
    separate = [w.engine.precompute_after(ctx, ids) for ids, ctx in zip(chunks, contexts, strict=True)]
    for got, want in zip(w.kv.compute(chunks, contexts), separate, strict=True):
        torch.testing.assert_close(got.k, want.k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.v, want.v, atol=1e-4, rtol=1e-4)
    keys = [w.kv.key_of(ids, ctx) for ids, ctx in zip(chunks, contexts, strict=True)]
    w.store.put_document(DocumentRecord(id="apple-runs", status="ready", chunk_keys=keys, precompute_at="first_use",
                                        chunk_tokens=[len(c) for c in chunks]), text="apple")
    cold = ask(w, chunks, keys, contexts, 20)
    assert cold.usage["chunks_computed"] == 3 and cold.kv_reads.get("source:recompute:first_use") == 3
    for blob, ids, ctx, want in zip(blobs(w, keys), chunks, contexts, separate, strict=True):
        assert blob is not None
        k, v, _ = kvblob.decode(blob, verify=True, copy=True)
        ref_k, ref_v, _ = kvblob.decode(w.kv._at_rest(ids, ctx, want)[0], verify=True, copy=True)
        for got, ref in ((k, ref_k), (v, ref_v)):
            got, ref = _floats(got), _floats(ref)
            step = float(ref.abs().amax()) / 127  # one int8 step at the largest scale
            assert float((got - ref).abs().max()) <= step * 1.01
    warm = ask(w, chunks, keys, contexts, 21)
    assert warm.usage["chunks_computed"] == 0 and warm.text == cold.text


def _floats(t) -> torch.Tensor:
    return t.dequantize() if hasattr(t, "dequantize") else t.float()
