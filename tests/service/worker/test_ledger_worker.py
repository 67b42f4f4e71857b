"""One device-memory ledger (kvfuse/fusion/engine/ledger.py) in the whole worker: queries over stored
chunks with a system prompt (the prefix cache), a samkv query (its probe inside its own extent), an
ingestion, a shadow check and the device tier all at once, and at every engine step the bytes each
holder really holds, and what the ledger counts, are within the one budget. docs/DESIGN.md, "One
device-memory ledger"."""

from __future__ import annotations

import pytest
from test_scheduler_worker import LONG_SYSTEM, MODEL_CACHE, essay_chunks, query

from kvfuse.config import load_settings
from kvfuse.service.wire import protocol as P
from kvfuse.service.worker.core import WorkerCore

pytestmark = pytest.mark.slow

BUDGET = 3000  # server.kv_budget_tokens
TIER_MB = 2  # store.device_tier_mb: about two int8 chunks of 64 tokens, so the tier evicts as well


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("ledger-worker")
    settings = load_settings(data_dir=root / "data", model_cache_dir=MODEL_CACHE, log_level="warning",
                             model={"max_context_tokens": 4096, "threads": 1},
                             server={"max_running_requests": 4, "kv_budget_tokens": BUDGET,
                                     "prefill_tokens_per_step": 256, "ingest_step_share": 0.5},
                             store={"device_tier_mb": TIER_MB},
                             fidelity={"shadow_rate": 1.0, "shadow_queue": 4})
    sent: list = []
    w = WorkerCore(settings, sent.append)
    w.sent = sent
    yield w
    w.store.close()


def physical(w: WorkerCore) -> dict[str, int]:
    """The bytes each holder really holds now, read off the holders themselves, not the ledger."""
    tier = w.store.device_tier
    return {"extents": w.core.memory.extent_bytes, "prefix": w.kv.prefixes.nbytes(),
            "device_tier": int(tier.stats()["device_bytes"])}


def test_every_holder_at_once_stays_within_the_one_budget(worker, essays, default_llm_path) -> None:
    w = worker
    chunks = essay_chunks(essays, default_llm_path, 10)
    token_bytes = w.core.memory.token_bytes
    budget = BUDGET * token_bytes
    info = w.info()["kv_ledger"]
    # the device tier's budget is carved from the one budget before the buffer is allocated
    assert info["budget_bytes"] == budget and info["caps"] == {"device_tier": TIER_MB << 20}
    assert w.core.memory.capacity == BUDGET - -(-(TIER_MB << 20) // token_bytes)

    w.sent.clear()
    w.receive(P.PrecomputeJob(chunks=chunks[:6], job_id=1))
    while w.has_work:
        w.step()
    done = next(m for m in w.sent if isinstance(m, P.Done))
    keys = dict(enumerate(done.keys))

    def stored(picks: list[int], job_id: int, **kw) -> P.QueryJob:
        job = query(chunks, picks, system_prompt=LONG_SYSTEM, **kw)
        job.chunks = [P.ChunkRef(keys[p], chunks[p], 1.0) for p in picks]
        job.job_id = job_id
        return job

    w.sent.clear()
    for msg in [stored([0, 1], 10, max_tokens=8), P.PrecomputeJob(chunks=chunks[6:], job_id=2),
                stored([2, 3, 4], 11, method="samkv", max_tokens=6), stored([5, 0], 12, max_tokens=8)]:
        assert w.receive(msg)
    seen: dict[str, int] = {}
    steps = 0
    while w.has_work:
        w.step()
        steps += 1
        now, holders = physical(w), w.core.ledger.holders()
        assert sum(now.values()) <= budget, (steps, now)
        assert sum(holders.values()) <= budget
        # the ledger counts at least what each holder holds (extents exactly; a prefix hold in whole tokens)
        assert holders["device_tier"] == now["device_tier"] and holders["prefix"] >= now["prefix"]
        assert holders["query"] + holders["shadow"] + holders["ingest"] == now["extents"]
        for kind, nbytes in holders.items():
            seen[kind] = max(seen.get(kind, 0), nbytes)
    out = list(w.sent)
    results = {m.job_id: m for m in out if isinstance(m, P.Result)}
    assert sorted(results) == [10, 11, 12] and all(r.usage["generated_tokens"] >= 1 for r in results.values())
    assert results[11].usage["context_tokens"] == 3 * 64  # samkv's, its probe inside its extent
    assert any(isinstance(m, P.Done) and m.job_id == 2 for m in out)
    assert any(isinstance(m, P.ShadowResult) for m in out)  # a shadow check ran on the core meanwhile
    reported = [m for m in out if isinstance(m, P.Step)]
    assert all(sum(s.ledger.values()) <= s.ledger_peak <= budget for s in reported)
    # every holder held bytes at some point, within the budget: read at step ends, and inside the steps
    # (an ingestion piece's reservation lives only while its piece runs) by the ledger's own peaks
    peaks = w.core.ledger.report().peak_holders
    for kind in ("query", "shadow", "prefix", "device_tier"):
        assert seen[kind] > 0, kind
    assert peaks["ingest"] > 0 and w.core.ledger.peak_bytes <= budget
    assert w.store.device_tier.evictions > 0  # the tier kept within its own bound by its own LRU
    # a shadow check's row is reported apart from the queries' rows
    assert any(s.shadow == 1 and s.running == 0 for s in reported)
    assert reported[-1].ledger["query"] == reported[-1].ledger["shadow"] == 0
