"""What an engine core's step returns (core.py): one output per event, in order, then one Stepped; as
vLLM v1's `EngineCore.step` returns its outputs instead of taking a callback."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvfuse.fusion.errors import FusionError

if TYPE_CHECKING:
    from kvfuse.fusion.engine.logprobs import TokenLogprob
    from kvfuse.fusion.engine.sequence import RequestId, Sequence


class Cancelled(FusionError):
    """The request was cancelled before it produced a token."""


@dataclass
class Admitted:
    job_id: RequestId
    seq: Sequence


@dataclass
class Token:
    job_id: RequestId
    text: str
    logprobs: list[TokenLogprob] | None = None
    index: int = 0  # the choice (n > 1) whose text this is


@dataclass
class Finished:
    job_id: RequestId
    seq: Sequence


@dataclass
class Failed:
    job_id: RequestId
    error: BaseException


@dataclass
class Preempted:
    """A preemptible request gave its KV memory to a query: it waits again, its Sequence reset, to be
    redone from the start (scheduler.py)."""

    job_id: RequestId
    seq: Sequence


@dataclass
class Ingested:
    job_id: RequestId
    value: object  # what the ingestion piece returned when it was done


@dataclass
class Stepped:
    step: int
    batch: int
    admitted: list[RequestId]
    ingest: RequestId | None
    running: int  # queries' rows (a shadow check's is counted apart, in `shadow`)
    waiting: int
    kv_tokens: int
    kv_bytes: int
    seconds: float = 0.0  # the step's wall time (ingestion's share is one of time: Scheduler.spent)
    shadow: int = 0  # running preemptible rows (shadow checks)
    ledger: dict[str, int] = field(default_factory=dict)  # device KV bytes by holder after the step (ledger.py)
    ledger_peak: int = 0  # the most device KV bytes the ledger read in this step


Output = Admitted | Token | Finished | Failed | Preempted | Ingested | Stepped
Emit = Callable[[Output], None]  # how the step's parts append to its outputs
