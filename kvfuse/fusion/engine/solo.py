"""The batch of one: `generate` and `decode_from`, one request as one Sequence on an engine core of its own.

The core (core.py) is the only driver of the decode step, so a library caller, a benchmark and the
service's worker decode through the same scheduler, runner, sampling and non-finite check; here the core
is sized for this one request (its KV memory is the request's cache, its prefill budget the whole
prompt) and its outputs become the TokenDelta / GenerationResult stream callers read
(docs/DESIGN.md, "Decoding: the engine core"). FusionEngine fuses; it does not decode, so it names
nothing here (no import cycle between the engine and the core).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING

import torch

from kvfuse.fusion.engine import outputs as E
from kvfuse.fusion.engine.core import EngineCore
from kvfuse.fusion.engine.requests import SchedulerLimits
from kvfuse.fusion.engine.sequence import Sequence
from kvfuse.fusion.methods import get_method
from kvfuse.fusion.types import (
    ChunkKV,
    FusedPrefill,
    FusionOptions,
    GenerationOptions,
    GenerationResult,
    TokenDelta,
)

if TYPE_CHECKING:
    from kvfuse.fusion.engine.fusing import FusingEngine

OnStep = Callable[[torch.Tensor, int], None]  # (the logits a token was chosen from, that token)
_ID = 0  # the one request's id on its own core


class _SoloSequence(Sequence):
    """A Sequence whose every chosen token is shown to `on_step` with the logits it came from."""

    on_step: OnStep | None = None

    def accept(self, logits: torch.Tensor) -> str:
        return self._seen(logits, super().accept(logits))

    def accept_token(self, token: int, logits: torch.Tensor) -> str:
        return self._seen(logits, super().accept_token(token, logits))

    def _seen(self, logits: torch.Tensor, text: str) -> str:
        if self.on_step is not None and self.gen is not None and self.gen.last_token is not None:
            self.on_step(logits, self.gen.last_token)
        return text


class _PrefilledSequence(_SoloSequence):
    """A Sequence over a prefill already fused (`decode_from`): its cache is the prefill's own, so it holds
    one token of the core's memory, the least an extent can be."""

    def __init__(self, fused: FusedPrefill, gen: GenerationOptions, forced: list[int] | None = None) -> None:
        super().__init__(_ID, [], [], None, gen, kv_tokens=1, prefill_tokens=0, forced=forced)
        self._fused = fused

    def start(self, engine: FusingEngine, new_cache: Callable[[int], object]) -> None:
        fused = self._fused

        def prefilled() -> Generator[int, None, FusedPrefill]:
            return fused
            yield 0  # a generator that is done at once

        self._t_loaded = time.perf_counter()
        self._steps = prefilled()


def generate(engine: FusingEngine, prefix: ChunkKV | None, chunks: list[ChunkKV], question_ids: list[int],
             fusion: FusionOptions | None = None, gen: GenerationOptions | None = None,
             cancel: Callable[[], bool] | None = None) -> Iterator[TokenDelta | GenerationResult]:
    """Yields TokenDelta as text becomes printable, then one GenerationResult: `engine`'s fused prefill
    of prefix + chunks + question, decoded on a core of its own. `cancel` is polled before each engine
    step once the request is admitted; a failure is raised (Cancelled when the cancel came before the
    first token)."""
    fusion = fusion if fusion is not None else FusionOptions()
    gen = gen or GenerationOptions()
    if gen.max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    p = prefix if prefix is not None else ChunkKV([])
    rows = get_method(fusion.method).tokens_per_chunk(fusion) * len(chunks)
    prompt = len(p) + sum(len(c) for c in chunks) + rows + len(question_ids)
    seq = _SoloSequence(_ID, p.token_ids, question_ids, fusion, gen, kv_tokens=prompt + gen.max_tokens,
                        prefill_tokens=prompt, prefix=prefix, chunks=chunks)
    return _drive(engine, seq, cancel, time.perf_counter())


def decode_from(engine: FusingEngine, fused: FusedPrefill, gen: GenerationOptions,
                cancel: Callable[[], bool] | None = None, *, started: float, on_step: OnStep | None = None
                ) -> Iterator[TokenDelta | GenerationResult]:
    """Decoding after a prefill already fused (the fidelity benchmark, which keeps every step), on a core
    as `generate` decodes. `started`: when the prefill began (perf_counter), for TTFT; `on_step(logits,
    token)` sees each step's logits and the token chosen from them, the stop token included."""
    seq = _PrefilledSequence(fused, gen)
    seq.on_step = on_step
    return _drive(engine, seq, cancel, started)


def forced_logits(engine: FusingEngine, fused: FusedPrefill, feed: list[int]) -> torch.Tensor:
    """Teacher forcing on a core: `feed` decoded after the prefill already fused, whatever the logits
    choose; the logits the tokens came from, [1 + len(feed), vocab] fp32: the prefill's, then one after
    each fed token."""
    rows: list[torch.Tensor] = []
    seq = _PrefilledSequence(fused, GenerationOptions(max_tokens=len(feed) + 1, temperature=0.0), forced=list(feed))
    seq.on_step = lambda logits, _token: rows.append(logits.detach().float())
    for _ in _outputs(engine, seq, None):
        pass
    return torch.stack(rows)


def _outputs(engine: FusingEngine, seq: _SoloSequence, cancel: Callable[[], bool] | None
             ) -> Iterator[list[E.Output]]:
    """Step a core of its own until `seq` ends, yielding each step's outputs; `cancel` is polled before
    every step once it is admitted. A failure (a bad request, non-finite logits, a cancel before the first
    token) is raised."""
    limits = SchedulerLimits(max_running=1, kv_budget_tokens=seq.kv_tokens,
                             prefill_tokens_per_step=max(1, seq.prefill_tokens), ingest_share=0.0)
    core = EngineCore(engine, limits)
    core.add(seq)
    while core.has_work:
        admitted = core.step_no > 0
        outs = core.abort(_ID) if admitted and cancel is not None and cancel() else core.step()
        for out in outs:
            if isinstance(out, E.Failed):
                raise out.error
        yield outs


def _drive(engine: FusingEngine, seq: _SoloSequence, cancel: Callable[[], bool] | None, started: float
           ) -> Iterator[TokenDelta | GenerationResult]:
    """`seq`'s outputs as the stream callers read: its text deltas, then its result."""
    for outs in _outputs(engine, seq, cancel):
        for out in outs:
            if isinstance(out, E.Token):
                yield TokenDelta(out.text)
            elif isinstance(out, E.Finished):
                yield _result(seq, started)


def _result(seq: Sequence, started: float) -> GenerationResult:
    assert seq.gen is not None  # a finished sequence has taken its first token
    timings = {k: v for k, v in seq.timings.items() if k != "kv_load_s"}
    timings["ttft_s"] = seq.first_token_at - started
    timings["decode_s"] = seq.decode_s
    return seq.gen.result(seq.stats, timings)
