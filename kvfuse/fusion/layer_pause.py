"""The model's own forward, paused between its decoder layers: how a chunk's precompute is cut into
slices of layers, so the engine core can run an ingestion piece a few layers per step, as it runs a fused
prefill (docs/DESIGN.md, "Bounded under load").

Why the model's own forward and not the engine's layer loop (transformer.py): a precompute is
transformers' forward by definition (the load check compares the engine with it, and stored chunks were
computed by it), so cutting it must not change one bit of what it computes; running it ourselves layer
by layer would mean writing out every family's preamble (Gemma's scaled embedding, Gemma 3's rope per
layer type, the masks of sliding layers) a second time. The forward cannot be suspended from outside
its loop, so it runs on a thread of its own that waits before each decoder layer (a forward pre-hook,
`LayerPause`) until the caller's generator is resumed: one thread computes at a time, the same kernels
on the same inputs, so the KV is the unpaused forward's byte for byte (tests/fusion/test_layer_pause.py).
Only the forward run through `steps` pauses: any other forward (the caller's own, meanwhile) passes
the hooks, which look at the thread they run on.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class _Abandoned(BaseException):
    """Raised inside a paused forward whose caller went away (its generator closed): it unwinds there."""


class _Turn:
    """One paused forward's hand-over between its thread and the caller."""

    def __init__(self) -> None:
        self.resume = threading.Semaphore(0)
        self.events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.abandoned = False
        self.layers_seen = 0


class LayerPause:
    """Pre-hooks on `layers` (the model's decoder layers), registered once, that pause the forward run by
    `steps` before every layer but the first."""

    def __init__(self, layers: torch.nn.ModuleList) -> None:
        self._turns: dict[int, _Turn] = {}  # thread id -> the turn of the paused forward running on it
        for layer in layers:
            layer.register_forward_pre_hook(self._before_layer)

    def _before_layer(self, _module: torch.nn.Module, _args: Any) -> None:
        turn = self._turns.get(threading.get_ident())
        if turn is None:  # a forward not run by `steps`
            return
        turn.layers_seen += 1
        if turn.layers_seen > 1:  # the layer before this one ran: hand over, wait to be resumed
            turn.events.put(("layer", None))
            turn.resume.acquire()
        if turn.abandoned:
            raise _Abandoned

    def steps(self, run: Callable[[], T]) -> Generator[None, None, T]:
        """`run()` (a forward of the model, under inference mode) on a thread of its own, yielding after
        every decoder layer but the last and returning what it returned; each resumption runs one more
        layer (the first: the embedding and layer 0; the last: the last layer and what follows it).
        Closing the generator mid-forward abandons the forward (it raises inside it) and waits for its
        thread to end, so nothing of it outlives the caller."""
        turn = _Turn()

        def body() -> None:
            self._turns[threading.get_ident()] = turn
            try:
                with torch.inference_mode():
                    turn.events.put(("done", run()))
            except _Abandoned:
                turn.events.put(("abandoned", None))
            except BaseException as err:  # noqa: BLE001 - handed to the caller, raised there
                turn.events.put(("error", err))
            finally:
                self._turns.pop(threading.get_ident(), None)

        thread = threading.Thread(target=body, name="kvfuse-layer-steps", daemon=True)
        thread.start()
        try:
            while True:
                kind, value = turn.events.get()
                if kind == "done":
                    return value
                if kind == "error":
                    raise value
                yield
                turn.resume.release()
        finally:
            if thread.is_alive():
                turn.abandoned = True
                turn.resume.release()
                thread.join()
