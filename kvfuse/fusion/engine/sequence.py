"""One query in the engine, from admission to its last token: its prompt, its fused prefill run a few
decoder layers per step, then its generation state.

The engine core (core.py) drives it: `start` loads the chunks' KV (`load_kv`, which a service overrides
to read its store) and sets up the fused prefill over the cache the scheduler's extent gives it;
`advance` runs the prefill for a budget of rows x layers and takes the first token when it completes;
after that each batched decode step hands it one token (`accept_token`). Everything that makes a request
*that* request lives here or in its `Generation`, so it decodes the same tokens alone or in a batch.

A request for `n` choices (OpenAI's `n`) is one Sequence through its prefill; when that completes, the
core forks n - 1 more rows from it (`fork`), as vLLM's parallel sampling forks child requests from a
parent: each gets a copy of the fused cache in an extent of its own and a Generation of its own, whose
first token is chosen from the same prefill logits. Choice i samples with seed `choice_seed(seed, i)`,
so choice 0 is the n = 1 answer and every choice is reproducible alone (docs/DESIGN.md, "Decoding").
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING

import torch

from kvfuse.fusion.engine.fused_cache import FusedCache
from kvfuse.fusion.engine.generation import Generation
from kvfuse.fusion.errors import NonFiniteLogits
from kvfuse.fusion.types import ChunkKV, FusedPrefill, FusionOptions, GenerationOptions

if TYPE_CHECKING:
    from kvfuse.fusion.engine.fusing import FusingEngine

RequestId = int  # one request's id, from its arrival to its last output (the wire's job_id in the service)
NewCache = Callable[[int], FusedCache]  # a cache for this many tokens (the engine core: a view of the extent)


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed choice `index` of a request samples with: `seed + index` (vLLM v1's rule for `n`), so
    choice 0 is the request's n = 1 answer and choice i is a solo run with seed + i; None stays None
    (each row's generator then seeds itself from OS entropy)."""
    return None if seed is None else seed + index


class Sequence:
    """A query for the engine core. `prefix` and `chunks`: the loaded KV (or override `load_kv`);
    `kv_tokens`: the cache it needs (prompt + max_tokens, and any rows its method adds); `prefill_tokens`:
    an estimate of its prefill work; `on_logits(row)`: sees every logits row it takes a token from; `n`: the
    choices decoded from its one prefill (each row holds `kv_tokens`); `index`: which choice this row is.

    `forced`: teacher forcing -- the first tokens it takes, whatever its logits choose (then the sampler's
    as usual); a forced sequence has no stop tokens or strings of the model's (an answer is fed whole, an
    EOS inside it included), and no penalties (they count the sampler's choices, not the forced tokens).
    `model_stops=False`: the model's stop tokens and strings do not end it either (a benchmark's stream,
    which must run its `max_tokens`); the request's own `stop` strings still do."""

    def __init__(self, request_id: RequestId, prefix_ids: list[int], question_ids: list[int], fusion: FusionOptions | None,
                 gen_options: GenerationOptions, *, kv_tokens: int, prefill_tokens: int,
                 prefix: ChunkKV | None = None, chunks: list[ChunkKV] | None = None,
                 forced: list[int] | None = None, model_stops: bool = True, n: int = 1) -> None:
        if forced is not None and (gen_options.presence_penalty or gen_options.frequency_penalty):
            raise ValueError("forced tokens cannot be taken with penalties (they count the sampler's choices)")
        self.request_id = request_id
        self.n, self.index = n, 0
        self.parent: Sequence | None = None  # the row it was forked from (choices 1..n-1)
        self.first_logits: torch.Tensor | None = None  # the prefill's, kept for the forks (n > 1)
        self.prefix_ids = prefix_ids
        self.question_ids = question_ids
        self.fusion = fusion
        self.gen_options = gen_options
        self.kv_tokens = kv_tokens
        self.prefill_tokens = prefill_tokens
        self._prefix, self._chunks = prefix, chunks
        self.forced = forced
        self.model_stops = model_stops and forced is None
        self.gen: Generation | None = None  # from the first token on
        self.cache: FusedCache | None = None  # a view of its extent, from the first token on
        self.stats: dict[str, int] = {}
        self.timings: dict[str, float] = {}
        self.on_logits: Callable[[torch.Tensor], None] | None = None
        self._steps: Generator[int, None, FusedPrefill] | None = None
        self._t_loaded = self._t_first = 0.0

    # -- prefill ------------------------------------------------------------------------------------------
    def load_kv(self) -> tuple[ChunkKV | None, list[ChunkKV]]:
        """The system prefix's and the chunks' KV (token ids only for a full-prefill method)."""
        return self._prefix, list(self._chunks or [])

    def start(self, engine: FusingEngine, new_cache: NewCache) -> None:
        """Load the chunks' KV and set up the fused prefill (over caches `new_cache(capacity)` gives), which
        `advance` then runs in pieces."""
        t0 = time.perf_counter()
        prefix, chunks = self.load_kv()
        self._t_loaded = time.perf_counter()
        self.timings = {"kv_load_s": self._t_loaded - t0}
        self._steps = engine.fuse_steps(prefix, chunks, self.question_ids, self.fusion,
                                        max_tokens=self.gen_options.max_tokens, new_cache=new_cache)

    def reset(self) -> None:
        """Back to before `start` (it was preempted, its extent freed): the next admission redoes it."""
        if self._steps is not None:
            self._steps.close()
        self._steps, self.gen, self.cache, self.first_logits = None, None, None, None
        self.stats, self.timings = {}, {}
        self._t_loaded = self._t_first = 0.0

    def advance(self, engine: FusingEngine, budget: int) -> tuple[int, str | None]:
        """Run the prefill for about `budget` rows x layers (at least one layer): (work done, the first
        token's text once the prefill is complete, else None). Prefill logits that are not finite raise
        NonFiniteLogits, as a decode step's row fails in the core."""
        if self._steps is None:
            raise RuntimeError("the sequence is not prefilling")
        spent = 0
        try:
            while spent < budget:
                spent += next(self._steps)
        except StopIteration as done:
            fused = done.value
        else:
            return spent, None
        self._steps = None
        if not bool(torch.isfinite(fused.logits).all()):
            raise NonFiniteLogits()
        self.cache, self.stats = fused.cache, fused.stats
        self.first_logits = fused.logits if self.n > 1 else None
        stops, stop_strings = (engine.stop_token_ids, engine.stop_strings) if self.model_stops else (set(), ())
        self.gen = Generation(engine.tokenizer, stops, self.gen_options, engine.device, stop_strings)
        text = self.accept(fused.logits)
        self._t_first = time.perf_counter()
        # ttft_s counts from the loaded KV to the first token, including steps spent on other sequences.
        self.timings.update(fused.timings, ttft_s=self._t_first - self._t_loaded)
        return spent, text

    def fork(self, engine: FusingEngine, index: int, cache: FusedCache) -> tuple[Sequence, str]:
        """Choice `index` of this request, over `cache` (a copy of this one's fused cache, FusedCache.fork)
        and a Generation of its own (seed `choice_seed(seed, index)`): the row and its first token's text,
        chosen from the prefill's logits as this row's was."""
        if self.first_logits is None:
            raise RuntimeError(f"request {self.request_id} has no prefill to fork from")
        opts = dataclasses.replace(self.gen_options, seed=choice_seed(self.gen_options.seed, index))
        row = Sequence(self.request_id, self.prefix_ids, self.question_ids, self.fusion, opts,
                       kv_tokens=self.kv_tokens, prefill_tokens=0, model_stops=self.model_stops, n=self.n)
        row.index, row.parent, row.cache, row.stats = index, self, cache, self.stats
        row.timings, row._t_loaded = dict(self.timings), self._t_loaded
        stops, stop_strings = (engine.stop_token_ids, engine.stop_strings) if self.model_stops else (set(), ())
        row.gen = Generation(engine.tokenizer, stops, opts, engine.device, stop_strings)
        text = row.accept(self.first_logits)
        row._t_first = time.perf_counter()
        return row, text

    @property
    def generation(self) -> Generation:
        """Its generation state (from the first token on; before that a RuntimeError)."""
        if self.gen is None:
            raise RuntimeError(f"request {self.request_id} has no token yet")
        return self.gen

    @property
    def fused_cache(self) -> FusedCache:
        """Its cache (from the first token on; before that a RuntimeError)."""
        if self.cache is None:
            raise RuntimeError(f"request {self.request_id} has no cache yet")
        return self.cache

    @property
    def prefilling(self) -> bool:
        return self._steps is not None

    # -- tokens -----------------------------------------------------------------------------------------------
    def accept(self, logits: torch.Tensor) -> str:
        """Choose and take the first token from the prefill's logits (the forced one, if any)."""
        if self.on_logits is not None:
            self.on_logits(logits)
        forced = self._forced_next()
        return self.generation.accept(logits) if forced is None else self.generation.accept_token(forced, logits)

    def accept_token(self, token: int, logits: torch.Tensor) -> str:
        """Take the token the batch chose for this request from its row `logits` [vocab] of the step (the
        forced one instead, while there is one)."""
        if self.on_logits is not None:
            self.on_logits(logits)
        forced = self._forced_next()
        return self.generation.accept_token(token if forced is None else forced, logits)

    def _forced_next(self) -> int | None:
        taken = self.generation.accepted
        return self.forced[taken] if self.forced is not None and taken < len(self.forced) else None

    @property
    def first_token_at(self) -> float:
        """When the first token was taken (perf_counter; 0 before)."""
        return self._t_first

    @property
    def decode_s(self) -> float:
        return time.perf_counter() - self._t_first if self._t_first else 0.0
