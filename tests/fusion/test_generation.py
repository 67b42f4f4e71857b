"""One request's decoding state on its own (the real tokenizer, logits chosen by the test): the same
object drives the batch of one in `solo.generate` and every sequence of the service's batches."""

from __future__ import annotations

import pytest
import torch

from kvfuse.fusion.engine.generation import Generation
from kvfuse.fusion.types import GenerationOptions


def onehot(token: int, vocab: int) -> torch.Tensor:
    logits = torch.full((vocab,), -10.0)
    logits[token] = 10.0
    return logits


def feed(gen: Generation, tokens: list[int], vocab: int) -> list[str]:
    out = []
    for t in tokens:
        if gen.finished is not None:
            break
        out.append(gen.accept(onehot(t, vocab)))
    return out


EOS = 2


def make(tokenizer, **opts) -> Generation:
    return Generation(tokenizer, {EOS}, GenerationOptions(**opts))


def test_max_tokens_ends_with_length_and_text_matches_the_tokens(tokenizer) -> None:
    ids = tokenizer(" The quick brown fox jumps over the lazy dog", add_special_tokens=False)["input_ids"]
    gen = make(tokenizer, max_tokens=4)
    deltas = feed(gen, ids, len(tokenizer))
    assert gen.finished == "length" and gen.token_ids == ids[:4]
    assert "".join(deltas) == gen.text == tokenizer.decode(ids[:4])
    result = gen.result({"prefix_tokens": 1, "context_tokens": 2, "question_tokens": 3, "recomputed_tokens": 0}, {})
    assert result.usage["generated_tokens"] == 4 and result.decode_steps == 3


def test_eos_stops_without_keeping_the_token(tokenizer) -> None:
    ids = tokenizer(" Hello there", add_special_tokens=False)["input_ids"]
    gen = make(tokenizer, max_tokens=50)
    feed(gen, [*ids, EOS, ids[0]], len(tokenizer))
    assert gen.finished == "stop" and gen.token_ids == ids and gen.decode_steps == len(ids)


def test_stop_string_is_never_emitted_even_across_tokens(tokenizer) -> None:
    ids = tokenizer(" one two three four", add_special_tokens=False)["input_ids"]
    gen = make(tokenizer, max_tokens=50, stop=["three"])
    deltas = feed(gen, ids, len(tokenizer))
    assert gen.finished == "stop" and "".join(deltas) == gen.text == " one two "


def test_cancel_flushes_held_text_and_ends(tokenizer) -> None:
    ids = tokenizer(" alpha beta", add_special_tokens=False)["input_ids"]
    gen = make(tokenizer, max_tokens=50, stop=["beta gamma"])
    deltas = feed(gen, ids, len(tokenizer))  # "beta" is held back: it may start the stop string
    assert "".join(deltas) == " alpha "
    assert gen.cancel() == "beta" and gen.finished == "cancelled"
    with pytest.raises(RuntimeError):
        gen.accept(onehot(ids[0], len(tokenizer)))


def test_seeded_sampling_is_per_sequence(tokenizer) -> None:
    torch.manual_seed(0)
    rows = [torch.randn(len(tokenizer)) for _ in range(8)]
    opts = {"max_tokens": 8, "temperature": 1.0, "top_p": 0.9, "seed": 5}
    a, b, other = make(tokenizer, **opts), make(tokenizer, **opts), make(tokenizer, **{**opts, "seed": 6})
    for row in rows:  # interleaved, as in a batch: one sequence's draws never disturb another's
        for g in (a, other, b):
            if g.finished is None:
                g.accept(row)
    assert a.token_ids == b.token_ids != other.token_ids
