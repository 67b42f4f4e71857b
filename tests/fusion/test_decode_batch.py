"""The batched decode step: B sequences with different contexts and lengths decoded together give the
same logits and the same greedy continuations as each sequence decoded alone."""

from __future__ import annotations

import pytest
import torch

from kvfuse.fusion import FusionError, FusionOptions

pytestmark = pytest.mark.slow

STEPS = 6


def _fused(engine, prompt, method):
    return engine.fuse(prompt.prefix, prompt.chunks, prompt.question_ids,
                       FusionOptions(method=method, recompute_ratio=0.3), max_tokens=STEPS)


def _alone(engine, prompt, method) -> tuple[list[torch.Tensor], list[int]]:
    """Per-step logits and the greedy tokens of one sequence decoded by itself."""
    fused = _fused(engine, prompt, method)
    token = int(torch.argmax(fused.logits))
    logits, tokens = [], [token]
    for _ in range(STEPS - 1):
        row = engine.decode_batch([fused.cache], torch.tensor([token]))[0]
        logits.append(row)
        token = int(torch.argmax(row))
        tokens.append(token)
    return logits, tokens


@pytest.mark.parametrize("method", ["pie", "anchor"])
def test_batch_matches_each_sequence_alone(engine, prompts, method):
    alone = [_alone(engine, p, method) for p in prompts]
    fused = [_fused(engine, p, method) for p in prompts]
    assert len({f.cache.length for f in fused}) == len(prompts)  # different lengths in one batch
    tokens = [[int(torch.argmax(f.logits))] for f in fused]
    for step in range(STEPS - 1):
        logits = engine.decode_batch([f.cache for f in fused], torch.tensor([t[-1] for t in tokens]))
        assert logits.shape == (len(prompts), engine.model.config.vocab_size) and logits.dtype == torch.float32
        for i, (ref_logits, _) in enumerate(alone):
            torch.testing.assert_close(logits[i], ref_logits[step], atol=1e-4, rtol=0)
            tokens[i].append(int(torch.argmax(logits[i])))
    assert tokens == [ref_tokens for _, ref_tokens in alone]
    for f, p in zip(fused, prompts, strict=True):
        assert f.cache.length == len(p.ids) + STEPS - 1


def test_one_sequence_matches_the_model(engine, prompts, hf_greedy):
    """The batch of one continues a vanilla prefill exactly as the HF model's own greedy decoding."""
    p = prompts[0]
    fused = engine.fuse(p.prefix, p.chunks, p.question_ids, FusionOptions(method="vanilla"),
                        max_tokens=len(hf_greedy))
    tokens = [int(torch.argmax(fused.logits))]
    while len(tokens) < len(hf_greedy):
        tokens.append(int(torch.argmax(engine.decode_batch([fused.cache], torch.tensor([tokens[-1]]))[0])))
    assert tokens == hf_greedy


def test_full_cache_is_refused(engine, prompts):
    fused = _fused(engine, prompts[1], "pie")
    other = _fused(engine, prompts[0], "pie")
    fused.cache.length = fused.cache.capacity
    with pytest.raises(FusionError, match="sequence 1"):
        engine.decode_batch([other.cache, fused.cache], torch.tensor([1, 2]))
    assert other.cache.length == len(prompts[0].ids)  # nothing was appended


@pytest.mark.parametrize("method", ["vanilla", "anchor", "a3"])
def test_a_prefill_run_a_layer_at_a_time_is_the_prefill(engine, prompts, method) -> None:
    """fuse_steps pauses after every decoder layer (the scheduler spreads a long prefill over steps):
    the pauses change nothing, and each reports the rows that layer ran."""
    p = prompts[2]
    whole = _fused(engine, p, method)
    steps = engine.fuse_steps(p.prefix, p.chunks, p.question_ids, FusionOptions(method=method, recompute_ratio=0.3),
                              max_tokens=STEPS)
    work = []
    while True:
        try:
            work.append(next(steps))
        except StopIteration as done:
            stepped = done.value
            break
    total = whole.stats["prefix_tokens"] + whole.stats["context_tokens"] + whole.stats["question_tokens"]
    if method == "vanilla":
        assert work == [total] * engine.num_layers
    else:  # the recomputed rows through the layers after the full ones (a3: its check layers first)
        rows = whole.stats["recomputed_tokens"] + whole.stats["question_tokens"]
        assert rows in work and len(work) >= engine.num_layers - whole.stats["full_layers"] - 1
    assert torch.equal(stepped.logits, whole.logits)
    n = whole.cache.length
    assert stepped.cache.length == n
    assert torch.equal(stepped.cache.k[:, :, :n], whole.cache.k[:, :, :n])
    assert torch.equal(stepped.cache.v[:, :, :n], whole.cache.v[:, :, :n])
