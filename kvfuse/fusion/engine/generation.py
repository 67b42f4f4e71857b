"""One request's decoding state, kept apart from the forward pass so that many requests can share it.

A batched decode step produces one row of logits per running sequence; everything that makes a request
*that* request -- its sampler and seed, its incremental detokenizer, its stop strings, `max_tokens`, EOS
and cancellation -- lives here, per sequence. `solo.generate` (the batch of one) and the
service's core (the batch of many) both reach it through the engine core, so a request decodes the same tokens
alone or in a batch.
"""

from __future__ import annotations

import torch

from kvfuse.fusion.engine import sampling
from kvfuse.fusion.engine.detokenize import IncrementalDetokenizer, StopMatcher, Tokenizer
from kvfuse.fusion.engine.logprobs import TokenLogprob, token_logprob
from kvfuse.fusion.engine.sampling import RowSampling
from kvfuse.fusion.types import FinishReason, GenerationOptions, GenerationResult


class Generation:
    """Turns successive next-token logits into text deltas until the request is finished.

    Call `accept(logits)` with the prefill's logits, then with each decode step's row (or
    `accept_token` with the token a batched `sampling.choose` picked from that row); feed `last_token`
    to the next decode step while `finished` is None.
    """

    def __init__(self, tokenizer: Tokenizer, stop_token_ids: set[int], options: GenerationOptions,
                 device: torch.device | str = "cpu", stop_strings: tuple[str, ...] = ()) -> None:
        """`stop_strings`: the model's own, beside the request's (a base model's: prompt_style.BASE_STOPS)."""
        if options.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        self.options = options
        self.stop_token_ids = stop_token_ids
        bias: dict[int | str, float] = {t: b for t, b in options.logit_bias.items()}
        self.sampling = RowSampling.create(options.temperature, options.top_p, options.seed, torch.device(device),
                                           bias, options.presence_penalty, options.frequency_penalty)
        if options.grammar is not None:  # response_format: a matcher of the request's own (engine/grammar.py)
            from kvfuse.fusion.engine.grammar import RowGrammar

            self.sampling.grammar = RowGrammar(options.grammar, tokenizer, stop_token_ids)
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = StopMatcher(list(dict.fromkeys([*options.stop, *stop_strings])))
        self.token_ids: list[int] = []
        self.last_token: int | None = None
        self.finished: FinishReason | None = None
        self.accepted = 0  # logits rows consumed: the prefill's, then one per decode step
        self.logprobs: list[TokenLogprob] = []  # per kept token, when options.logprobs is set (fusion/engine/logprobs.py)
        self._logprobs_taken = 0

    @property
    def decode_steps(self) -> int:
        """Forward steps after the prefill (one more than tokens kept when EOS ended it)."""
        return max(0, self.accepted - 1)

    def accept(self, logits: torch.Tensor) -> str:
        """Choose the next token from `logits` [vocab] (a batch of one of `sampling.choose`, so the same
        tokens as in any batch); returns the text now safe to emit (may be "")."""
        if self.finished is not None:
            raise RuntimeError("the generation is finished")
        return self.accept_token(int(sampling.choose(logits.view(1, -1), [self.sampling])[0]), logits)

    def accept_token(self, token: int, logits: torch.Tensor | None = None) -> str:
        """Take the token chosen for this request (by a batched `sampling.choose` over its logits row
        `logits` [vocab], needed only when the request asks for log-probabilities); returns the text now
        safe to emit (may be "")."""
        if self.finished is not None:
            raise RuntimeError("the generation is finished")
        self.accepted += 1
        self.last_token = token
        if token in self.stop_token_ids:
            return self._finish("stop")
        if self.sampling.grammar is not None:
            self.sampling.grammar.advance(token)
        self.token_ids.append(token)
        if self.options.logprobs is not None:
            if logits is None:
                raise ValueError("log-probabilities were asked for: accept_token needs the token's logits row")
            self.logprobs.append(token_logprob(logits, token, self.options.logprobs))
        text, stopped = self.stops.feed(self.detok.push(token))
        if stopped:
            self.finished = "stop"  # the text after the stop string is dropped, not flushed
            return text
        if len(self.token_ids) >= self.options.max_tokens:
            return text + self._finish("length")
        return text

    def take_logprobs(self) -> list[TokenLogprob]:
        """The log-probabilities of the tokens kept since the last call (what a streamed delta carries)."""
        out = self.logprobs[self._logprobs_taken:]
        self._logprobs_taken = len(self.logprobs)
        return out

    def cancel(self) -> str:
        """End now (client gone); returns the held-back tail, which is final."""
        return "" if self.finished is not None else self._finish("cancelled")

    def _finish(self, reason: FinishReason) -> str:
        self.finished = reason
        return self.stops.flush()  # text held back as a possible stop-string start is final now

    @property
    def text(self) -> str:
        return self.stops.text[: self.stops.emitted]

    def result(self, stats: dict[str, int], timings: dict[str, float]) -> GenerationResult:
        usage = {
            "prefix_tokens": stats["prefix_tokens"], "context_tokens": stats["context_tokens"],
            "question_tokens": stats["question_tokens"], "recomputed_tokens": stats["recomputed_tokens"],
            "generated_tokens": len(self.token_ids),
        }
        return GenerationResult(self.text, self.finished or "length", usage, timings, list(self.token_ids),
                                self.decode_steps, dict(stats), list(self.logprobs))

