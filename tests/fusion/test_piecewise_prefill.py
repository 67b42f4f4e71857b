"""The full prefill a piece of rows at a time (fusion/piecewise_prefill.py) is the full prefill: the same
last-row logits and cache as the plain HF forward of the whole prompt, at any piece size, and its work
comes in units no larger than a piece."""

from __future__ import annotations

import pytest
import torch
from fusion_helpers import hf_forward

from kvfuse.fusion.piecewise_prefill import prefill_steps

ATOL = 2e-4  # fp32 logits of a 30-layer model, as tests/fusion/test_fusion_engine.py


def run(steps):
    units = []
    while True:
        try:
            units.append(next(steps))
        except StopIteration as done:
            return done.value, units


@pytest.fixture(scope="module")
def reference(engine, prompt):
    out = hf_forward(engine, prompt.ids, logits_to_keep=1)
    k = torch.stack([layer.keys[0] for layer in out.past_key_values.layers])
    return out.logits[0, -1].float(), k


@pytest.mark.parametrize("piece", [1, 17, 64, 10_000])
def test_pieces_give_the_whole_prefills_logits_and_cache(engine, prompt, reference, piece):
    parts = [prompt.prefix.token_ids, *[c.token_ids for c in prompt.chunks], prompt.question_ids]
    n = len(prompt.ids)
    fused, units = run(prefill_steps(engine, parts, piece, max_tokens=5))
    ref_logits, ref_k = reference
    torch.testing.assert_close(fused.logits, ref_logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(fused.cache.k[:, :, :n], ref_k, atol=1e-4, rtol=1e-4)
    assert fused.cache.length == n and fused.cache.capacity == n + 5
    assert max(units) == min(piece, n) and sum(units) == n * engine.num_layers
    assert fused.stats["context_tokens"] == sum(len(c.token_ids) for c in prompt.chunks)


def test_a_decode_after_pieces_continues_as_after_a_whole_prefill(engine, prompt):
    from kvfuse.fusion import FusionOptions

    parts = [prompt.prefix.token_ids, *[c.token_ids for c in prompt.chunks], prompt.question_ids]
    whole = engine.fuse(prompt.prefix, prompt.chunks, prompt.question_ids, FusionOptions(method="vanilla"),
                        max_tokens=3)
    pieces, _ = run(prefill_steps(engine, parts, 40, max_tokens=3))
    token = int(whole.logits.argmax())
    torch.testing.assert_close(engine.decode_step(pieces.cache, token), engine.decode_step(whole.cache, token),
                               atol=ATOL, rtol=0)


def test_bad_pieces_and_empty_question_are_refused(engine):
    with pytest.raises(ValueError, match="piece_rows"):
        next(prefill_steps(engine, [[1], [2]], 0))
    with pytest.raises(ValueError, match="question"):
        next(prefill_steps(engine, [[1], [2], []], 8))
