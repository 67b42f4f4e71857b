"""Decode streams on the engine core, for the benchmarks that time decode steps (`kvfuse bench decode`,
`gpu`, `evict`): copies of one fused prefill, each a Sequence whose extent of the core's KV memory
receives the copy, decoded by `EngineCore.step` -- the one decode loop, the worker's (kvfuse/fusion/engine/
core.py) -- so a timed step is the step the service runs: the batched forward, the tokens chosen on the
device with one host copy, the non-finite check and each row's detokenizer.

The streams are greedy and ignore the model's stop tokens, so the batch stays whole through a timed window
(docs/results/decode/README.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from typing import Any

from kvfuse.fusion.engine.core import EngineCore
from kvfuse.fusion.engine.fused_cache import FusedCache
from kvfuse.fusion.engine.outputs import Failed, Stepped
from kvfuse.fusion.engine.requests import SchedulerLimits
from kvfuse.fusion.engine.runner import BLOCK
from kvfuse.fusion.engine.sequence import Sequence
from kvfuse.fusion.types import FusedPrefill, GenerationOptions


class CopiedPrefill(Sequence):
    """A stream: `fused`'s cache (its slots, length and position offset) copied into the extent the core
    gives it; its first token chosen from `fused`'s logits; it runs until the cache's room is spent.
    `grammar`: the answer's (engine/grammar.py)."""

    def __init__(self, request_id: int, fused: FusedPrefill, grammar: str | None = None) -> None:
        room = fused.cache.capacity - fused.cache.length  # decode steps it can append: one token more kept
        super().__init__(request_id, [], [], None, GenerationOptions(max_tokens=room + 1, temperature=0.0,
                                                                     grammar=grammar),
                         kv_tokens=fused.cache.capacity, prefill_tokens=0, model_stops=False)
        self._fused = fused

    def start(self, engine: Any, new_cache: Callable[[int], FusedCache]) -> None:
        src, cache = self._fused.cache, new_cache(self.kv_tokens)
        cache.place(0, src.k[:, :, : src.length], src.v[:, :, : src.length])
        cache.length, cache.position_offset = src.length, src.position_offset
        f = self._fused
        copied = FusedPrefill(cache, f.logits, f.selected, dict(f.stats), {})

        def prefilled() -> Generator[int, None, FusedPrefill]:
            return copied
            yield 0  # a generator that is done at once

        self._t_loaded = time.perf_counter()
        self._steps = prefilled()


def core_streams(engine: Any, fused: FusedPrefill, streams: int, *, static: bool = False,
                 grammar: str | None = None) -> EngineCore:
    """An engine core whose KV memory holds `streams` copies of `fused`, every one decoding when this
    returns (its first token taken, one decode step run), for the rest of the room `fused.cache` has past
    its prompt; static: the core's static path (on CUDA captured as graphs), warmed up."""
    per_stream = fused.cache.capacity
    if static:  # each extent whole key blocks, and one block for the runner's scratch token
        budget = (streams * -(-per_stream // BLOCK) + 1) * BLOCK
    else:
        budget = streams * per_stream
    limits = SchedulerLimits(max_running=streams, kv_budget_tokens=budget, prefill_tokens_per_step=1,
                             ingest_share=0.0)
    core = EngineCore(engine, limits, static=static, cuda_graphs=static and engine.device.type == "cuda")
    if static:
        core.warm_up()
    for i in range(streams):
        core.add(CopiedPrefill(i, fused, grammar))
    while len(core.scheduler.decode_batch()) < streams:
        for out in core.step():
            if isinstance(out, Failed):
                raise out.error
    return core


def time_steps(core: EngineCore, steps: int, warmup: int = 0) -> list[float]:
    """Seconds per `core.step()` of `steps` steps (after `warmup` untimed ones), each a decode step of the
    whole batch (checked: a stream that ended or failed would shrink it)."""
    batch = len(core.scheduler.decode_batch())
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        outs = core.step()
        elapsed = time.perf_counter() - t
        stepped = outs[-1]
        if not isinstance(stepped, Stepped) or stepped.batch != batch:
            raise RuntimeError(f"a timed step decoded {getattr(stepped, 'batch', 0)} streams, not {batch}")
        if i >= warmup:
            times.append(elapsed)
    return times
