"""Which shadow checks compare answers (worker/shadow.py): only an answer that was the argmax of the
model's own logits has the full prefill's greedy answer as its reference; a sampled one, or one adjusted
by a logit_bias, a penalty or a grammar (engine/sampling.py), is checked for its KL alone."""

from __future__ import annotations

from kvfuse.fusion.types import GenerationOptions
from kvfuse.service.worker.shadow import _plain_greedy


def test_only_unadjusted_greedy_answers_are_compared_with_the_full_prefills() -> None:
    assert _plain_greedy(GenerationOptions(temperature=0.0))
    assert not _plain_greedy(GenerationOptions(temperature=0.7))
    assert not _plain_greedy(GenerationOptions(temperature=0.0, logit_bias={504: -100.0}))
    assert not _plain_greedy(GenerationOptions(temperature=0.0, presence_penalty=0.5))
    assert not _plain_greedy(GenerationOptions(temperature=0.0, frequency_penalty=-1.0))
    # a response_format grammar masks the model's choice too
    assert not _plain_greedy(GenerationOptions(temperature=0.0, grammar='{"grammars": []}'))
