"""Decoding on the fused cache: stop strings, max_tokens, cancel, EOS, seeded sampling, UTF-8-safe deltas."""

from __future__ import annotations

import pytest

from kvfuse.fusion import FusionOptions, GenerationOptions, GenerationResult, TokenDelta
from kvfuse.fusion.engine import solo
from kvfuse.fusion.engine.detokenize import IncrementalDetokenizer, StopMatcher

PIE = FusionOptions(method="pie")


def run(engine, prompt, gen: GenerationOptions, cancel=None) -> tuple[list[str], GenerationResult]:
    events = list(solo.generate(engine, prompt.prefix, prompt.chunks, prompt.question_ids, PIE, gen, cancel))
    *deltas, result = events
    assert all(isinstance(d, TokenDelta) for d in deltas) and isinstance(result, GenerationResult)
    return [d.text for d in deltas], result


@pytest.mark.slow
def test_max_tokens_usage_and_timings(engine, prompt):
    deltas, result = run(engine, prompt, GenerationOptions(max_tokens=5))
    assert result.finish_reason == "length" and len(result.token_ids) == 5
    assert "".join(deltas) == result.text == engine.tokenizer.decode(result.token_ids)
    assert result.usage == {"prefix_tokens": len(prompt.prefix), "context_tokens": 168,
                            "question_tokens": len(prompt.question_ids), "recomputed_tokens": 0,
                            "generated_tokens": 5}
    assert set(result.timings) == {"assemble_s", "select_s", "recompute_s", "full_layers_s", "kv_copy_s",
                                   "kv_copy_exposed_s", "ttft_s", "decode_s"}
    # on a CPU nothing overlaps the chunks' copy into the fused cache: all of it is exposed
    assert result.timings["kv_copy_exposed_s"] == result.timings["kv_copy_s"] > 0
    assert 0 < result.timings["ttft_s"] and result.timings["decode_s"] > 0


@pytest.mark.slow
def test_stop_string_ends_the_text_before_it(engine, prompt):
    _, full = run(engine, prompt, GenerationOptions(max_tokens=12))
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert len(stop) == 3
    deltas, result = run(engine, prompt, GenerationOptions(max_tokens=12, stop=[stop]))
    assert result.finish_reason == "stop"
    assert result.text == full.text[: full.text.index(stop)] == "".join(deltas)


@pytest.mark.slow
def test_eos_ends_generation(engine, prompt):
    _, result = run(engine, prompt, GenerationOptions(max_tokens=200))
    assert result.finish_reason == "stop" and len(result.token_ids) < 200  # the model ends its answer
    assert not set(result.token_ids) & engine.stop_token_ids


@pytest.mark.slow
def test_cancel_is_checked_every_step(engine, prompt):
    """cancel is polled before every engine step once the request is admitted: cancelled on the fourth
    poll, the answer ends as cancelled with the tokens of the steps before it, those of the full answer."""
    calls = []

    def cancel() -> bool:
        calls.append(1)
        return len(calls) > 3

    _, full = run(engine, prompt, GenerationOptions(max_tokens=50))
    deltas, result = run(engine, prompt, GenerationOptions(max_tokens=50), cancel)
    assert result.finish_reason == "cancelled" and len(calls) == 4
    assert 0 < len(result.token_ids) < 50 and result.token_ids == full.token_ids[: len(result.token_ids)]
    assert "".join(deltas) == result.text


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_and_utf8_safe(engine, prompt):
    gen = GenerationOptions(max_tokens=24, temperature=1.3, top_p=0.95, seed=7)
    deltas, a = run(engine, prompt, gen)
    _, b = run(engine, prompt, gen)
    _, c = run(engine, prompt, GenerationOptions(max_tokens=24, temperature=1.3, top_p=0.95, seed=8))
    assert a.token_ids == b.token_ids != c.token_ids
    assert all("\ufffd" not in d for d in deltas) and "".join(deltas) == a.text


@pytest.mark.slow
def test_incremental_detokenizer_never_splits_a_character(engine):
    text = "Café 🙂 naïve — 東京 🇯🇵 done"
    ids = engine.tokenize(text)
    detok = IncrementalDetokenizer(engine.tokenizer)
    deltas = [detok.push(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == engine.tokenizer.decode(ids) == text
    assert sum(1 for d in deltas if d == "") > 0  # some tokens carry only part of a character


def test_stop_matcher_holds_back_a_partial_stop():
    m = StopMatcher(["END"])
    assert m.feed("abc E") == ("abc ", False)  # "E" may start "END"
    assert m.feed("N") == ("", False)
    assert m.feed("Dxyz") == ("", True)
    assert m.text == "abc "
    m = StopMatcher(["END"])
    assert m.feed("abc E") == ("abc ", False)
    assert m.feed("x") == ("Ex", False)
    assert m.flush() == ""


def test_decode_steps_count_every_forward_after_the_first(engine, prompt, monkeypatch):
    """Steps after the first token: one per kept token after it, plus the step whose token was EOS."""
    opts, gen = FusionOptions(method="vanilla"), GenerationOptions(max_tokens=6)
    full = list(solo.generate(engine, prompt.prefix, prompt.chunks, prompt.question_ids, opts, gen))[-1]
    assert (full.finish_reason, len(full.token_ids), full.decode_steps) == ("length", 6, 5)
    # the third greedy token made an end-of-turn token: two kept, two steps run (the second produced it)
    monkeypatch.setattr(engine, "stop_token_ids", engine.stop_token_ids | {full.token_ids[2]})
    cut = list(solo.generate(engine, prompt.prefix, prompt.chunks, prompt.question_ids, opts, gen))[-1]
    assert (cut.finish_reason, cut.token_ids, cut.decode_steps) == ("stop", full.token_ids[:2], 2)
