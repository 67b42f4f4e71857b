"""Answer KL, bootstrap intervals and the vanilla reference cache (docs/DESIGN.md, "Fidelity measures").

The math is pinned on hand-computed cases; the end-to-end part runs the real default model: vanilla
teacher-forced on its own cache is at KL 0 from itself, and a second run over the same examples reads
vanilla back from disk instead of computing it."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from kvfuse.bench.agreement import (
    answer_kl,
    bootstrap_ci,
    examples_for_width,
    teacher_forced_logits,
    token_kls,
)


def test_token_kl_hand_computed():
    p = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]], dtype=torch.float64))
    q = torch.log(torch.tensor([[0.25, 0.75], [0.9, 0.1]], dtype=torch.float64))
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    kls = token_kls(p, q)
    assert kls[0] == pytest.approx(expected, abs=1e-12) and kls[1] == pytest.approx(0.0, abs=1e-12)
    assert answer_kl(p, q) == pytest.approx(expected / 2, abs=1e-12)
    # logits, not only log-probs: a shift of every logit is the same distribution
    assert answer_kl(p, q + 3.0) == pytest.approx(expected / 2, abs=1e-12)
    assert answer_kl(p, p) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError):
        token_kls(p, q[:1])


def test_bootstrap_interval():
    assert bootstrap_ci([1.0]) is None
    assert bootstrap_ci([0.3] * 10) == pytest.approx((0.3, 0.3))
    values = [0.0, 1.0] * 50
    lo, hi = bootstrap_ci(values)
    assert lo < 0.5 < hi
    # binomial: half-width about 1.96 * sqrt(0.25 / 100) = 0.098
    assert (hi - lo) / 2 == pytest.approx(0.098, abs=0.015)
    assert bootstrap_ci(values) == (lo, hi)  # seeded
    # width scales as 1/sqrt(n): halving the half-width takes four times the examples
    assert examples_for_width(100, (lo, hi), (hi - lo) / 4) == pytest.approx(400, abs=2)


@pytest.mark.slow
def test_answer_kl_and_reference_reuse(default_llm_path: str, shared_data: Path, tmp_path: Path):
    from kvfuse.bench import tasks
    from kvfuse.bench.engine_backend import EngineBackend
    from kvfuse.bench.fidelity import aggregate, run_examples
    from kvfuse.config import Settings

    settings = Settings(model_cache_dir=Path(default_llm_path).parent)
    refs = tmp_path / "refs"
    backend = EngineBackend(settings, max_tokens=8, reference_dir=refs)
    cfg = tasks.TaskConfig(n=2, docs=2, doc_tokens=48, seed=0)
    examples = tasks.build_examples("needle", backend.tokenizer, shared_data, cfg)
    plan = [("vanilla", 1.0), ("a3", 1.0), ("full_reuse", 0.0)]
    first = run_examples(backend, examples, plan)
    assert backend.references.misses == 2 and backend.references.hits == 0
    by = {(o.example_id, o.method): o for o in first}
    for ex in examples:
        assert by[(ex.id, "vanilla")].answer_kl_vs_vanilla == 0.0  # the reference itself
        # a full recompute against vanilla: KL ~ 0
        assert by[(ex.id, "a3")].answer_kl_vs_vanilla < 1e-3
        assert by[(ex.id, "full_reuse")].answer_kl_vs_vanilla > by[(ex.id, "a3")].answer_kl_vs_vanilla
    assert len(list(refs.rglob("*.pt"))) == 2

    # A method teacher-forced on its own cache along its own greedy answer gives its decode steps'
    # distributions: vanilla, samkv's compacted sparse cache, and a cache evicted after the prefill (its
    # slots are not its positions).
    prefix, chunks, question_ids = backend.prepare(examples[0])
    for method, ratio, evict in (("vanilla", 1.0, 0), ("samkv", 0.15, 0), ("a3", 0.15, 64)):
        opts = dataclasses.replace(backend.options(method, ratio), evict_capacity=evict)
        backend.ingest_artifacts(method, chunks)
        ans = backend.greedy(prefix, chunks, question_ids, opts, 8, keep_steps=True)
        assert len(ans.tokens) > 1, method
        forced = teacher_forced_logits(backend.engine, ans.fused, ans.tokens)
        assert forced.shape == ans.steps.shape, method
        assert max(token_kls(ans.steps, forced)) < 1e-6, method

    again = EngineBackend(settings, max_tokens=8, reference_dir=refs)
    second = run_examples(again, examples, plan)
    assert again.references.hits == 2 and again.references.misses == 0
    for a, b in zip(first, second, strict=True):
        assert (a.method, a.prediction, a.score) == (b.method, b.prediction, b.score)
        if a.method != "vanilla":
            assert b.answer_kl_vs_vanilla == pytest.approx(a.answer_kl_vs_vanilla, rel=1e-3, abs=1e-6)
    # another answer budget is another generation setting: a miss
    other = EngineBackend(settings, max_tokens=6, reference_dir=refs)
    run_examples(other, examples[:1], plan[:1])
    assert other.references.misses == 1
    rows = {r["method"]: r for r in aggregate(second)}
    assert rows["a3"]["same_answer_vs_vanilla"] == 1.0 and rows["a3"]["same_answer_vs_vanilla_ci"] == [1.0, 1.0]
    assert rows["full_reuse"]["answer_kl_vs_vanilla_ci"][0] <= rows["full_reuse"]["answer_kl_vs_vanilla"]
