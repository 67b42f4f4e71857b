"""`kvfuse bench fidelity` sends the prompt the service sends: for the same documents and question, the
in-process bench's prefix, chunk and question token ids are the worker's (`plan_query` on the job the
service builds: the configured system prompt, the documents in `model.prompt_order`, each rendered by the
service's corpus as `model.prompt_layout` has it), with no answer prefix. On the default model (a chat
template) in both layouts, and on the real Gemma 3 270M (a base model: the base-model prompt)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfuse.bench import multidoc, tasks
from kvfuse.bench.cli import service_doc_order
from kvfuse.bench.engine_backend import EngineBackend
from kvfuse.fusion.engine.core import EngineCore
from kvfuse.fusion.engine.requests import SchedulerLimits
from kvfuse.fusion.prompt import in_prompt_order
from kvfuse.retriever import Chunker
from kvfuse.service.rag.corpus import Corpus
from kvfuse.service.wire import protocol as P
from kvfuse.service.worker.sequences import plan_query
from kvfuse.store import KVStore
from kvfuse.store.records import DocumentRecord

CFG = tasks.TaskConfig(n=1, docs=4, doc_tokens=120, seed=3)


def _service_prompt(settings, engine, ranked: tasks.Example) -> tuple[list[int], list[list[int]], list[int]]:
    """(prefix, chunks, question) ids as the service sends them: `ranked`'s documents (best first, as the
    retriever hands them over) each stored as a one-chunk document titled with its essay, put in the
    prompt's order, planned by the worker."""
    with KVStore.open(settings) as store:
        corpus = Corpus(settings, store)
        corpus.chunker = Chunker(engine.tokenizer, settings.retriever.chunk_tokens)
        hits = []
        for i, (text, title) in enumerate(zip(ranked.chunks, ranked.titles, strict=True)):
            assert len(corpus.chunker.chunk(text)) == 1  # each document is one chunk, as in the bench
            rec = DocumentRecord(f"doc{i}", "ready", {"title": title})
            ids = corpus.prompt_blocks([corpus.chunker.encode(text)], corpus.prompt_name(rec))[0]
            hits.append(P.ChunkRef(f"key{i}", ids, 1.0 - i / 10, corpus.prompt_name(rec)))
    chunks = in_prompt_order(hits, settings.model.prompt_order)
    job = P.QueryJob(ranked.question, settings.model.system_prompt, False, {"method": "anchor", "cold_chunks": "compute"},
                     {"max_tokens": 4}, chunks, 1)  # compute: the plan looks up no tier
    core = EngineCore(engine, SchedulerLimits(max_running=4, kv_budget_tokens=100_000, prefill_tokens_per_step=2048,
                                              ingest_share=0.25))
    seq = plan_query(job, engine, core, 8192, 0, kv=None)  # planning reads no KV
    assert not isinstance(seq, P.Error), seq
    assert seq.kept == list(range(len(chunks)))
    return seq.prefix_ids, [c.token_ids for c in chunks], seq.question_ids


def _bench_and_service_agree(settings, shared_data: Path) -> EngineBackend:
    backend = EngineBackend(settings, max_tokens=4)
    engine = backend.engine
    corpus = multidoc.Corpus(engine.tokenizer, shared_data, CFG.doc_tokens)
    embed = backend.embedder().embed
    ranked = multidoc.build_examples("needle", corpus, CFG, "retrieval", embed)[0]
    ex = multidoc.build_examples("needle", corpus, CFG, service_doc_order(settings.model.prompt_order), embed)[0]
    assert ex.answer_prefix  # the task has one (RULER's) ...
    prefix, question = backend.question_ids(ex)
    want_prefix, want_chunks, want_question = _service_prompt(settings, engine, ranked)
    assert prefix == want_prefix
    assert backend.chunk_ids(ex) == want_chunks
    assert question == want_question  # ... which the bench leaves out, as the service must
    backend.answer_prefix = True  # the opt-in: RULER's answer prefix after the service's question part
    assert backend.question_ids(ex)[1] == want_question + engine.tokenize(ex.answer_prefix)
    return backend


@pytest.mark.parametrize("layout", ["plain", "labelled"])
def test_the_bench_prompts_the_default_model_as_the_service_does(layout, settings_factory, shared_data: Path) -> None:
    settings = settings_factory(redis_url="", model={"prompt_layout": layout})
    assert settings.model.prompt_order == "best-last"  # the default: the best document next to the question
    backend = _bench_and_service_agree(settings, shared_data)
    assert backend.engine.prompt_style.name == "chat"


@pytest.mark.slow
def test_the_bench_prompts_a_base_model_as_the_service_does(settings_factory, shared_data: Path,
                                                            gemma3_path: Path) -> None:
    settings = settings_factory(redis_url="", model={"llm": str(gemma3_path), "prompt_order": "best-first"})
    backend = _bench_and_service_agree(settings, shared_data)
    assert backend.engine.prompt_style.name == "base"
