"""The question-only probe (SelectionContext.question_probe) on the real default model: scoring only the
layers a method reads, normalised by the attention kernel's log-sum-exp, gives the scores and the
selections of the probe written out as before (an fp32 softmax over every key at every layer up to the
last one read, its output from those probabilities)."""

from __future__ import annotations

import pytest
import torch
from fusion_helpers import make_prompt

from kvfuse.fusion import FusionOptions
from kvfuse.fusion.engine.fused_cache import FusedCache
from kvfuse.fusion.methods import get_method, scoring
from kvfuse.fusion.methods.anchor import Anchor, layer_window
from kvfuse.fusion.methods.selection import SelectionContext
from kvfuse.fusion.types import Layout


class SoftmaxProbe(SelectionContext):
    """The probe as it was: every layer up to the last one asked for scored by an fp32 softmax."""

    def question_probe(self, layers: range) -> torch.Tensor:
        tf, cache, positions = self.tf, self.cache, self.question_positions
        rows = self.make_rows(positions)
        h = tf.embed(self.ids[positions])
        per_layer = []
        for layer in range(layers.stop):
            q, k, v = tf.project(layer, h, rows.cos, rows.sin)
            cache.write(layer, positions, k, v)
            probs = scoring.attention_probs(q, positions, cache.keys(layer, self.layout.total), tf.scale)
            per_layer.append(probs[:, :, self.context].mean(dim=1))
            out = scoring.apply_probs(probs, cache.values(layer, self.layout.total)).to(h.dtype)
            h = tf.finish(layer, h, out)
        return torch.stack(per_layer)[layers.start :]


def context(engine, prompt, options: FusionOptions, cls=SelectionContext) -> SelectionContext:
    """The selection context `fuse` builds for a method with no full layers (the cache assembled)."""
    prefix, chunks = prompt.prefix, prompt.chunks
    layout = Layout(len(prefix), [len(c) for c in chunks], len(prompt.question_ids))
    ids = torch.tensor(prompt.ids, dtype=torch.long)
    cache = FusedCache(engine.num_layers, engine.num_kv_heads, engine.head_dim, layout.total, engine.dtype,
                       engine.device)
    engine._assemble(cache, prefix, chunks, layout, True)
    cache.finish_loading()
    return cls(engine.tf, cache, layout, ids, options, 0, engine.rows)


PROMPTS = [("apple", "What does the author think of the App Store?", [64, 48, 56]),
           (7, "What is the main point?", [90, 20, 41, 12]),
           (3, "Who is mentioned first, and why?", [120, 80, 100])]


@pytest.fixture(scope="module")
def prompts(engine, essays):
    texts = dict(essays)
    names = list(texts)
    return [make_prompt(engine, texts[e if isinstance(e, str) else names[e]], q, lens) for e, q, lens in PROMPTS]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["anchor", "prophetkv"])
def test_probe_selects_as_the_softmax_probe_did(engine, prompts, method: str) -> None:
    window = layer_window(engine.num_layers, *Anchor.window)
    layers = window if method == "anchor" else range(engine.num_layers)
    for i, prompt in enumerate(prompts):
        options = FusionOptions(method=method)
        new, old = context(engine, prompt, options), context(engine, prompt, options, SoftmaxProbe)
        with torch.inference_mode():
            torch.testing.assert_close(new.question_probe(layers), old.question_probe(layers), atol=1e-6, rtol=1e-4)
            for ratio in (0.1, 0.25):  # the probe is memoised: only the budget changes
                new.budget = old.budget = scoring.budget(ratio, new.num_context)
                picked, before = get_method(method).select(new), get_method(method).select(old)
                assert torch.equal(picked, before), (method, i, ratio)


def test_probe_scores_only_the_layers_asked_for_and_reuses_a_covering_pass(engine, prompts) -> None:
    ctx = context(engine, prompts[0], FusionOptions(method="anchor"))
    with torch.inference_mode():
        deep = ctx.question_probe(range(10, 20))
        assert deep.shape[0] == 10 and ctx._probe[0] == range(10, 20)
        torch.testing.assert_close(ctx.question_probe(range(12, 15)), deep[2:5])  # from the same pass
        assert ctx._probe[0] == range(10, 20)
        wider = ctx.question_probe(range(5, 12))  # outside: one pass over both
        assert ctx._probe[0] == range(5, 20)
        torch.testing.assert_close(wider[5:], deep[:2], atol=1e-6, rtol=1e-5)
    sums = deep.sum(dim=-1)  # the context's share of each head's attention: a probability mass
    assert bool(((sums > 0) & (sums <= 1 + 1e-5)).all())
