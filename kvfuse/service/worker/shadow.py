"""Shadow checks: a share of finished fused queries re-run as a full prefill when the worker is idle, to
measure live what fusion changed in the answers (docs/DESIGN.md, "The quality contract").

A query picked for a check (`fidelity.shadow_rate`, a deterministic credit: rate 0.25 picks every fourth)
keeps its fused answer's per-step distributions while it decodes (fp16 rows of the vocabulary, one per
token). When it finishes, a `ShadowCheck` takes the prompt's token ids (prefix, kept chunks, question),
the answer's tokens and those distributions; the query itself is retired as usual. Checks wait in a
bounded queue (`fidelity.shadow_queue` checks, `fidelity.shadow_memory_mb` of distributions): when either
is reached the oldest is dropped and counted.

A check runs only while the scheduler has nothing to do, in slices, and the worker reads its pipe
between slices, so a request that arrives waits for at most one slice. A slice is small by design, far
smaller than a live prefill's engine step: at most `fidelity.shadow_slice_tokens` prompt rows through
every decoder layer, or one decode step (docs/results/contract/ has what a larger slice cost under load).

1. the full prefill of the same token ids, a piece of `shadow_slice_tokens` consecutive positions at a
   time (chunked prefill, kvfuse/fusion/piecewise_prefill.py: the same cache and logits as one whole
   prefill), one piece per slice;
2. teacher forcing: the fused answer's tokens through the full prefill's cache, a layer at a time
   within the same budget, giving P_full at every answer token; answer KL = mean KL(P_full ‖ P_fused);
3. when the fused answer was greedy (and not adjusted by a logit_bias or a penalty: those answers get
   the KL only, as sampled ones do), the full prefill's own greedy answer, compared with the fused one
   under `fidelity.metric` (kvfuse/answer_match.py). It shares the fused answer's tokens up to the first
   position where the teacher-forced argmax differs, so only the rest is decoded, on an engine core of
   its own over the full prefill's cache (engine/solo.py `replay_steps`), one engine step per slice (an
   answer the full prefill would have given token for token costs no decode step at all).

The verdict crosses to the API as a `ShadowResult` (counts only); the check and its token ids are then
dropped. A check in progress holds one full-prefill cache (prompt + answer) outside the KV budget.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from kvfuse.answer_match import same_answer
from kvfuse.service.wire import protocol as P

ENDS_SLICE = True  # a decode step is a slice of its own


def _plain_greedy(opts: Any) -> bool:
    """Whether the answer was the argmax of the model's own logits, so the full prefill's greedy answer is
    its reference. With logit_bias, penalties or a grammar (response_format) it is not (engine/sampling.py): the reference would have
    to be decoded under the same adjustment, which is not done; the KL, of the model's own distributions,
    still is measured."""
    adjusted = opts.logit_bias or opts.presence_penalty or opts.frequency_penalty or opts.grammar
    return opts.temperature == 0.0 and not adjusted


@dataclass
class ShadowCheck:
    """What one check needs, and nothing more of the query: token ids, the fused answer, its distributions."""

    method: str
    recompute_ratio: float
    prompt: list[list[int]]  # prefix, each kept chunk, question
    answer_tokens: list[int]  # the fused answer's tokens, its stop token included
    answer_text: str
    fused_steps: Any  # [len(answer_tokens), vocab] fp16 logits of the fused answer's steps
    greedy: bool
    max_tokens: int
    stop: list[str]

    @property
    def context_tokens(self) -> int:
        return sum(len(c) for c in self.prompt[1:-1])


class ShadowChecks:
    """The worker's shadow checks: which queries to watch, the pending queue, the check in progress."""

    def __init__(self, fidelity: Any, engine: Any) -> None:
        """fidelity: config.FidelitySettings. A slice's work, rows x layers: `shadow_slice_tokens` rows
        through every layer (a teacher-forced answer longer than that may overshoot by under one layer)."""
        self.rate = fidelity.shadow_rate
        self.metric = fidelity.metric
        self.engine = engine
        self.piece_rows = fidelity.shadow_slice_tokens
        self.slice_work = fidelity.shadow_slice_tokens * engine.num_layers
        self.queue: deque[ShadowCheck] = deque()
        self.max_checks = fidelity.shadow_queue
        self.max_bytes = int(fidelity.shadow_memory_mb * 2**20)
        self._credit = 0.0
        self._run: Generator[tuple[int, bool], None, P.ShadowResult] | None = None
        self._slices = self._max_slice = 0

    @property
    def pending(self) -> bool:
        return self._run is not None or bool(self.queue)

    # -- picking and keeping -------------------------------------------------------------------------------
    def watch(self, seq: Any) -> None:
        """Decide on arrival whether this query gets a check; if so its sequence keeps its answer's logits."""
        if self.rate <= 0 or seq.full_prefill:
            return
        self._credit += self.rate
        if self._credit >= 1.0 - 1e-9:
            self._credit -= 1.0
            seq.shadow_steps = []
            seq.on_logits = lambda logits, seq=seq: self.record(seq, logits)

    def offer(self, seq: Any, step: int) -> list[Any]:
        """A watched query finished: queue its check (messages to send: a ShadowDropped when the queue was
        full). A cancelled answer is not checked."""
        steps, seq.shadow_steps = seq.shadow_steps, None
        if steps is None or seq.gen is None or seq.gen.finished not in ("stop", "length") or not steps:
            return []
        import torch

        gen = seq.gen
        tokens = list(gen.token_ids)
        if gen.last_token in self.engine.stop_token_ids:
            tokens.append(gen.last_token)
        chunks = [seq.job.chunks[i].token_ids for i in seq.kept]
        opts = seq.gen_options
        check = ShadowCheck(seq.fusion.method, float(seq.fusion.recompute_ratio),
                            [list(seq.prefix_ids), *chunks, list(seq.question_ids)], tokens[: len(steps)], gen.text,
                            torch.stack(steps), _plain_greedy(opts), opts.max_tokens, list(opts.stop))
        self.queue.append(check)
        out: list[Any] = []
        while len(self.queue) > self.max_checks or (self.queue and self.held_bytes > self.max_bytes):
            out.append(P.ShadowDropped(self.queue.popleft().method, step))  # the oldest goes (even this one)
        return out

    @property
    def held_bytes(self) -> int:
        """What the pending checks' fused answer distributions hold."""
        return sum(c.fused_steps.numel() * c.fused_steps.element_size() for c in self.queue)

    @staticmethod
    def record(seq: Any, logits: Any) -> None:
        """Keep one step's logits of a watched query (fp16 on the CPU)."""
        if getattr(seq, "shadow_steps", None) is not None:
            seq.shadow_steps.append(logits.detach().reshape(-1).to("cpu", copy=True).half())

    def abandon(self) -> None:
        """Drop the check in progress (it failed)."""
        self._run = None

    # -- running ---------------------------------------------------------------------------------------------
    def run_slice(self, step: int) -> P.ShadowResult | None:
        """One slice of the check in progress (starting the oldest pending one if none is): the verdict
        when the check ends in this slice."""
        if self._run is None:
            if not self.queue:
                return None
            self._run = self._check(self.queue.popleft())
            self._slices = self._max_slice = 0
        spent = 0
        try:
            while spent < self.slice_work:
                work, ends = next(self._run)
                spent += work
                if ends:
                    break
        except StopIteration as done:
            verdict = done.value
        else:
            verdict = None
        self._slices += 1
        self._max_slice = max(self._max_slice, spent)
        if verdict is None:
            return None
        self._run = None
        verdict.slices, verdict.max_slice_work, verdict.step = self._slices, self._max_slice, step
        return verdict

    def _check(self, check: ShadowCheck) -> Generator[tuple[int, bool], None, P.ShadowResult]:
        from kvfuse.fusion.engine import solo
        from kvfuse.fusion.piecewise_prefill import prefill_steps
        from kvfuse.fusion.teacher_forcing import answer_kl, teacher_forced_steps
        from kvfuse.fusion.types import FusedPrefill, GenerationOptions

        engine = self.engine
        room = max(check.max_tokens, len(check.answer_tokens))
        fused = yield from _tagged(prefill_steps(engine, check.prompt, self.piece_rows, max_tokens=room), False)
        prompt_len = fused.cache.length
        logits = yield from _tagged(teacher_forced_steps(engine, fused, check.answer_tokens), False)
        kl = answer_kl(logits, check.fused_steps.float())
        agreed = None
        if check.greedy:
            # The full prefill's greedy answer shares the fused one's tokens up to the first position where
            # its teacher-forced argmax differs: replay those rows, decode only from there.
            chosen = logits.argmax(-1).tolist()
            j = next((i for i, (a, b) in enumerate(zip(chosen, check.answer_tokens, strict=True)) if a != b), None)
            if j is None:
                agreed = True  # the same tokens, so the same text
            else:
                fused.cache.length = prompt_len + j  # the rows of the shared tokens, written by teacher forcing
                diverged = FusedPrefill(fused.cache, logits[j], fused.selected, fused.stats, {})
                opts = GenerationOptions(max_tokens=check.max_tokens, temperature=0.0, stop=check.stop)
                # decoded on an engine core (the runner's step is under inference_mode), a step per slice
                text = yield from _tagged(solo.replay_steps(engine, diverged, logits[:j], opts), ENDS_SLICE)
                agreed = same_answer(check.answer_text, text, self.metric)
        return P.ShadowResult(check.method, check.recompute_ratio, check.context_tokens, agreed, kl,
                              len(check.answer_tokens))


def _tagged(steps: Generator[int, None, Any], ends_slice: bool) -> Generator[tuple[int, bool], None, Any]:
    """A stepped generator's work, each unit tagged `ends_slice` (True: a slice of its own, as an engine
    step is; False: sharing a slice with what follows, as a decoder layer does); returns its value."""
    while True:
        try:
            work = next(steps)
        except StopIteration as done:
            return done.value
        yield work, ends_slice
