"""Shadow checks: a share of finished fused queries re-run as a full prefill on the engine core, to
measure live what fusion changed in the answers (docs/DESIGN.md, "The quality contract").

A query picked for a check (`fidelity.shadow_rate`, a deterministic credit: rate 0.25 picks every fourth)
keeps its fused answer's per-step distributions while it decodes (fp16 rows of the vocabulary, one per
token). When it finishes, a `ShadowCheck` takes the prompt's token ids (prefix, kept chunks, question),
the answer's tokens and those distributions; the query itself is retired as usual. Checks wait in a
bounded queue (`fidelity.shadow_queue` checks, `fidelity.shadow_memory_mb` of distributions): when either
is reached the oldest is dropped and counted.

The check in progress (one at a time) is a `ShadowSequence` on the worker's own engine core, in the
scheduler's lowest, preemptible class (kvfuse/fusion/engine/scheduler.py): admitted only while no query
waits, its extent of prompt + answer tokens held in the same KV memory as every query's (so the budget
counts it), its prefill run from the budget a step's queries leave (none in a step with ingestion), and
preempted when a query needs its memory or its batch row (its extent freed, the check redone from the
start once there is room again). So a query arriving during a check waits for at most the rest of one
engine step. On the core it is:

1. the full prefill (`vanilla`) of the same token ids, a decoder layer at a time as any prefill;
2. teacher forcing: the fused answer's tokens taken as forced tokens (`Sequence(forced=...)`), one
   batched decode step each, the logits of each step being P_full at that answer token; answer KL =
   mean KL(P_full ‖ P_fused);
3. when the fused answer was greedy (and not adjusted by a logit_bias, a penalty or a grammar: those
   answers get the KL only, as sampled ones do), the full prefill's own greedy answer, compared with the
   fused one under `fidelity.metric` (kvfuse/answer_match.py). It shares the fused answer's tokens up to
   the first position j where the teacher-forced argmax differs, so the cache is cut back to the prompt
   + j rows teacher forcing wrote, those j tokens are replayed from the rows already computed, and only
   the rest is decoded, in the same sequence (an answer the full prefill would have given token for
   token costs no decode step past the forcing).

The verdict crosses to the API as a `ShadowResult` (counts only); the check and its token ids are then
dropped.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvfuse.answer_match import same_answer
from kvfuse.fusion.engine import outputs as E
from kvfuse.fusion.engine.generation import Generation
from kvfuse.fusion.engine.sequence import Sequence
from kvfuse.fusion.teacher_forcing import answer_kl
from kvfuse.fusion.types import ChunkKV, FusionOptions, GenerationOptions
from kvfuse.service.wire import protocol as P

if TYPE_CHECKING:
    from kvfuse.fusion.engine.core import EngineCore
    from kvfuse.fusion.engine.fusing import FusingEngine

log = logging.getLogger("kvfuse.worker")


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
    fused_steps: torch.Tensor  # [len(answer_tokens), vocab] fp16 logits of the fused answer's steps
    greedy: bool
    max_tokens: int
    stop: list[str]

    @property
    def context_tokens(self) -> int:
        return sum(len(c) for c in self.prompt[1:-1])

    @property
    def prompt_tokens(self) -> int:
        return sum(len(c) for c in self.prompt)


class ShadowSequence(Sequence):
    """A check on the engine core (the module docstring): the full prefill, the fused answer forced, then
    the greedy answer from the first divergence; `verdict` once it finished. `clock()`: the core's step
    number, to count the engine steps the check ran in and its largest step's work (rows x layers)."""

    def __init__(self, request_id: int, check: ShadowCheck, engine: FusingEngine, metric: str,
                 clock: Callable[[], int]) -> None:
        prefix, *chunks, question = check.prompt
        room = max(check.max_tokens, len(check.answer_tokens))  # forcing the answer, or the greedy answer
        super().__init__(request_id, list(prefix), list(question), FusionOptions(method="vanilla"),
                         GenerationOptions(max_tokens=room, temperature=0.0),
                         kv_tokens=check.prompt_tokens + room, prefill_tokens=check.prompt_tokens,
                         prefix=ChunkKV(list(prefix)), chunks=[ChunkKV(list(c)) for c in chunks],
                         forced=list(check.answer_tokens))
        self.check, self.engine, self.metric, self.clock = check, engine, metric, clock
        self.verdict: P.ShadowResult | None = None
        self.steps = self.max_step_work = 0
        self._step = self._step_work = 0
        self._rows: list[torch.Tensor] = []  # P_full at each answer token so far (fp32, CPU)
        self._forcing = True
        self._prompt_len = 0
        self._kl = 0.0

    def reset(self) -> None:
        super().reset()
        self.forced, self.verdict = list(self.check.answer_tokens), None
        self._rows, self._forcing = [], True

    # -- work accounting ---------------------------------------------------------------------------------
    def _count(self, work: int) -> None:
        step = self.clock()
        if step != self._step:
            self._step, self._step_work = step, 0
            self.steps += 1
        self._step_work += work
        self.max_step_work = max(self.max_step_work, self._step_work)

    def advance(self, engine: FusingEngine, budget: int) -> tuple[int, str | None]:
        spent, text = super().advance(engine, budget)
        self._count(spent)
        return spent, text

    # -- tokens ------------------------------------------------------------------------------------------
    def accept(self, logits: torch.Tensor) -> str:
        self._prompt_len = self.fused_cache.length  # the prefill is complete: the prompt's rows
        return self._taken(logits, lambda: super(ShadowSequence, self).accept(logits))

    def accept_token(self, token: int, logits: torch.Tensor) -> str:
        self._count(self.engine.num_layers)  # one row through every layer in the batched step
        return self._taken(logits, lambda: super(ShadowSequence, self).accept_token(token, logits))

    def _taken(self, logits: torch.Tensor, take: Callable[[], str]) -> str:
        """Take a token (forced while forcing, which keeps its row); the check's next phase when the
        forcing or the greedy answer ended. Its text is the check's own: nothing to emit."""
        if self._forcing:
            self._rows.append(logits.detach().reshape(-1).to("cpu", torch.float32, copy=True))
        take()
        gen = self.generation
        if self._forcing and len(self._rows) == len(self.check.answer_tokens):
            self._forced()
        elif not self._forcing and gen.finished is not None:
            self._judge(same_answer(self.check.answer_text, gen.text, self.metric))
        return ""

    def _forced(self) -> None:
        """The whole fused answer is forced: its KL, and the greedy answer where there is one to compare."""
        self._forcing = False
        check, rows = self.check, torch.stack(self._rows)
        self._kl = answer_kl(rows, check.fused_steps.float())
        if not check.greedy:
            return self._judge(None)
        chosen = rows.argmax(-1).tolist()
        j = next((i for i, (a, b) in enumerate(zip(chosen, check.answer_tokens, strict=True)) if a != b), None)
        if j is None:
            return self._judge(True)  # the same tokens, so the same text
        # The full prefill's greedy answer shares the fused one's first j tokens, whose rows teacher forcing
        # wrote: cut the cache back to them, replay them from their rows, decode only from there.
        self.fused_cache.length = self._prompt_len + j
        e = self.engine
        opts = GenerationOptions(max_tokens=check.max_tokens, temperature=0.0, stop=check.stop)
        gen = self.gen = Generation(e.tokenizer, e.stop_token_ids, opts, e.device, e.stop_strings)
        self.forced = None
        for row in self._rows[: j + 1]:
            gen.accept(row.to(e.device))
            if gen.finished is not None:
                return self._judge(same_answer(check.answer_text, gen.text, self.metric))
        return None

    def _judge(self, agreed: bool | None) -> None:
        check = self.check
        self.verdict = P.ShadowResult(check.method, check.recompute_ratio, check.context_tokens, agreed, self._kl,
                                      len(check.answer_tokens), self.steps, self.max_step_work)
        self.generation.finished = self.generation.finished or "length"  # the core retires it now


class ShadowChecks:
    """The worker's shadow checks: which queries to watch, the pending queue, the check on the core."""

    def __init__(self, fidelity: Any, engine: FusingEngine, core: EngineCore) -> None:
        """fidelity: config.FidelitySettings; core: the worker's engine core, which runs the checks."""
        self.rate = fidelity.shadow_rate
        self.metric = fidelity.metric
        self.engine, self.core = engine, core
        self.queue: deque[ShadowCheck] = deque()
        self.max_checks = fidelity.shadow_queue
        self.max_bytes = int(fidelity.shadow_memory_mb * 2**20)
        self._credit = 0.0
        self.running: ShadowSequence | None = None
        self.preempted = 0  # checks sent back by a query that needed their memory (each redone later)

    @property
    def pending(self) -> bool:
        return self.running is not None or bool(self.queue)

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
        """A watched query finished: queue its check and start it on the core if none runs (messages to
        send: a ShadowDropped when the queue was full). A cancelled answer is not checked."""
        steps, seq.shadow_steps = seq.shadow_steps, None
        if steps is None or seq.gen is None or seq.gen.finished not in ("stop", "length") or not steps:
            return []
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
        return out + self.submit(step)

    @property
    def held_bytes(self) -> int:
        """What the pending checks' fused answer distributions hold."""
        return sum(c.fused_steps.numel() * c.fused_steps.element_size() for c in self.queue)

    @staticmethod
    def record(seq: Any, logits: torch.Tensor) -> None:
        """Keep one step's logits of a watched query (fp16 on the CPU)."""
        if getattr(seq, "shadow_steps", None) is not None:
            seq.shadow_steps.append(logits.detach().reshape(-1).to("cpu", copy=True).half())

    # -- running ---------------------------------------------------------------------------------------------
    def submit(self, step: int) -> list[Any]:
        """Put the oldest pending check on the core when none is there; one that could never fit the KV
        memory is dropped and counted (a ShadowDropped to send)."""
        out: list[Any] = []
        while self.running is None and self.queue:
            check = self.queue.popleft()
            seq = ShadowSequence(self.core.private_id(), check, self.engine, self.metric, lambda: self.core.step_no)
            try:
                self.core.add(seq, preemptible=True)
            except ValueError:
                out.append(P.ShadowDropped(check.method, step))
                continue
            self.running = seq
        return out

    def owns(self, job_id: int) -> bool:
        """Whether an engine output of this id is the check in progress's."""
        return self.running is not None and job_id == self.running.request_id

    def on_output(self, out: E.Output, step: int) -> list[Any]:
        """An engine output of the check in progress: the messages to send (its verdict when it finished,
        then what starting the next check gives). A failed check is logged and dropped; queries go on."""
        done: list[Any] = []
        if isinstance(out, E.Preempted):
            self.preempted += 1
            return []
        if isinstance(out, E.Finished) and self.running is not None and self.running.verdict is not None:
            verdict = self.running.verdict
            verdict.step = step
            done.append(verdict)
        elif isinstance(out, E.Failed):
            log.error("shadow check failed: %s", out.error, exc_info=out.error)
        else:
            return []  # its admission and its (empty) text
        self.running = None
        return done + self.submit(step)
