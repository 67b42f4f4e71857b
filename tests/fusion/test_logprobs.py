"""Log-probabilities (fusion/engine/logprobs.py) pinned to the math: log-softmax of the logits row, the top ones
sorted and equal to the row's own largest values, and a Generation asked for them records one per kept
token (none for the EOS that ends it), handing each out once to the stream."""

from __future__ import annotations

import math

import torch

from kvfuse.fusion.engine.generation import Generation
from kvfuse.fusion.engine.logprobs import token_logprob
from kvfuse.fusion.types import GenerationOptions

EOS = 2


def test_the_chosen_and_top_logprobs_are_the_log_softmax_of_the_row() -> None:
    logits = torch.tensor([1.0, 3.0, 0.5, 3.0, -2.0])
    token, lp, top = token_logprob(logits, 2, 3)
    expected = logits - torch.logsumexp(logits, 0)
    assert token == 2 and math.isclose(lp, float(expected[2]), rel_tol=1e-6)
    assert [i for i, _ in top][:1] in ([1], [3]) and {i for i, _ in top[:2]} == {1, 3} and top[2][0] == 0
    assert all(math.isclose(v, float(expected[i]), rel_tol=1e-6) for i, v in top)
    assert math.isclose(sum(math.exp(float(v)) for v in expected), 1.0, rel_tol=1e-6)
    assert token_logprob(logits, 1, 0)[2] == []


def test_a_generation_records_each_kept_tokens_logprob_once(tokenizer) -> None:
    ids = tokenizer(" the quick brown fox", add_special_tokens=False)["input_ids"]
    gen = Generation(tokenizer, {EOS}, GenerationOptions(max_tokens=10, logprobs=2))
    vocab = len(tokenizer)
    generator = torch.Generator().manual_seed(0)
    rows = []
    taken = []
    for t in [*ids, EOS]:
        row = torch.randn(vocab, generator=generator)
        row[t] = 30.0  # greedy picks t
        rows.append(row)
        gen.accept(row)
        taken.extend(gen.take_logprobs())
    assert gen.finished == "stop" and [e[0] for e in gen.logprobs] == gen.token_ids == ids
    assert taken == gen.logprobs and gen.take_logprobs() == []
    for (token, lp, top), row in zip(gen.logprobs, rows, strict=False):
        assert math.isclose(lp, float(torch.log_softmax(row, 0)[token]), rel_tol=1e-5)
        assert top[0][0] == token and len(top) == 2
    assert gen.result({"prefix_tokens": 0, "context_tokens": 0, "question_tokens": 0, "recomputed_tokens": 0},
                      {}).logprobs == gen.logprobs
    plain = Generation(tokenizer, {EOS}, GenerationOptions(max_tokens=10))
    plain.accept(rows[0])
    assert plain.logprobs == []
