"""A precompute cut between decoder layers (kvfuse/fusion/layer_pause.py) is the model's own forward, byte
for byte, in every supported family (tiny random-weight models, tests/tiny_models.py: sliding windows,
soft-caps, Gemma 3's rope per layer type): each resumption runs one layer, a forward of the model run
meanwhile on the caller's thread neither pauses nor changes it, and closing it mid-forward leaves no
thread behind."""

from __future__ import annotations

import threading

import pytest
import tiny_models
import torch
from test_families import token_ids

from kvfuse.fusion import FusionEngine
from kvfuse.fusion.steps import advance, drain


@pytest.fixture(scope="module", params=list(tiny_models.FAMILIES))
def fam(request, tokenizer) -> FusionEngine:
    # chunks of similar length batched together up to 96 tokens: the batch below has two forwards
    return FusionEngine(tiny_models.build(request.param, len(tokenizer)), tokenizer, dtype="float32",
                        attention_block_rows=32, precompute_batch_tokens=96)


def same(a, b) -> bool:
    return len(a) == len(b) and all(x.token_ids == y.token_ids and torch.equal(x.k, y.k) and torch.equal(x.v, y.v)
                                    and x.after_context == y.after_context for x, y in zip(a, b, strict=True))


def resumptions(steps) -> tuple[int, object]:
    """How many times `steps` paused, and what it returned."""
    count = 0
    while True:
        done, value = advance(steps, 1)
        if done:
            return count, value
        count += 1


def pause_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvfuse-layer-steps"]


def test_a_paused_precompute_is_the_forward_byte_for_byte(fam) -> None:
    """Chunks alone (two padded batches: 40 + 33 and 60 tokens, one forward each) and a run after a
    context, each longer than every window: paused after every layer but each forward's last, equal to
    the unpaused forward in every layer's K/V."""
    a, b, c, context = token_ids([40, 33, 60, 47], seed=3)
    count, got = resumptions(fam.precompute_steps([a, b, c]))
    assert count == 2 * (fam.num_layers - 1) and same(got, fam.precompute([a, b, c]))
    count, got = resumptions(fam.precompute_run_steps(context, [a, b]))
    assert count == fam.num_layers - 1 and same(got, fam.precompute_run(context, [a, b]))
    count, got = resumptions(fam.precompute_run_steps(context, [c]))
    assert count == fam.num_layers - 1 and same(got, [fam.precompute_after(context, c)])
    assert resumptions(fam.precompute_run_steps([], [c]))[0] == fam.num_layers - 1  # alone: no context


def test_a_forward_meanwhile_neither_pauses_nor_changes_the_paused_one(fam) -> None:
    a, b = token_ids([50, 41], seed=4)
    steps = fam.precompute_run_steps(a, [b])
    assert not advance(steps, 2)[0]  # two layers run, paused before the third
    alone = fam.precompute([b])  # the caller's own forward runs whole while the other waits
    done, got = advance(steps, 0)
    assert done and same(got, [fam.precompute_after(a, b)]) and same(alone, fam.precompute([b]))


def test_closing_a_paused_precompute_ends_its_forward(fam) -> None:
    (a,) = token_ids([30], seed=5)
    steps = fam.precompute_steps([a])
    assert not advance(steps, 1)[0] and len(pause_threads()) == 1
    steps.close()
    assert pause_threads() == []
    assert same(drain(fam.precompute_steps([a])), fam.precompute([a]))  # the model is as before


def test_timed_counts_the_time_inside_resumptions_not_the_pauses_between_them() -> None:
    """A precompute's throughput is observed over the time its forward ran (ChunkCache._observed): the
    caller's work between two resumptions, here a sleep, is not counted, and closing the timer closes
    the work it times."""
    import time

    from kvfuse.fusion.steps import timed

    closed: list[bool] = []

    def work(slices: int):
        try:
            for _ in range(slices):
                yield
            return "value"
        finally:
            closed.append(True)

    steps = timed(work(2))
    next(steps)
    time.sleep(0.3)  # other engine steps while the forward waits
    next(steps)
    with pytest.raises(StopIteration) as done:
        next(steps)
    value, seconds = done.value.value
    assert value == "value" and 0 <= seconds < 0.3 and closed == [True]
    abandoned = timed(work(3))
    next(abandoned)
    abandoned.close()
    assert closed == [True, True]
