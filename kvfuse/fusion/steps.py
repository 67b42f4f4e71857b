"""Work written as a generator of steps, run whole (torch-free: the worker's chunk cache imports it).

A prefill or a precompute that can pause between decoder layers is a generator
(`FusionEngine.fuse_steps`, `FusionEngine.precompute_steps`, `ChunkCache.compute_steps`): the engine core
resumes it a slice at a time, and a caller that wants it whole drains it here.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import TypeVar

T = TypeVar("T")


def drain(steps: Generator[object, None, T]) -> T:
    """Run a generator of steps to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def advance(steps: Generator[object, None, T], count: int) -> tuple[bool, T | None]:
    """Resume `steps` up to `count` times (0: to its end): (True, its return value) once it ended, else
    (False, None), to be resumed again."""
    taken = 0
    while count <= 0 or taken < count:
        try:
            next(steps)
        except StopIteration as done:
            return True, done.value
        taken += 1
    return False, None


def timed(steps: Generator[object, None, T]) -> Generator[None, None, tuple[T, float]]:
    """`yield from timed(steps)`: `steps` resumed as the caller is, then (its return value, the seconds
    spent inside its resumptions): a paused forward's time, not the time other work ran while it waited.
    Closing it closes `steps`."""
    spent = 0.0
    try:
        while True:
            t = time.perf_counter()
            try:
                next(steps)
            except StopIteration as done:
                return done.value, spent + time.perf_counter() - t
            spent += time.perf_counter() - t
            yield
    finally:
        steps.close()
