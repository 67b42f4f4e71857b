"""What the engine core schedules (scheduler.py): a request, its phase, the step's plan and the limits, and
what an ingestion piece returns while it is paused between layers."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from kvfuse.fusion.engine.kv_memory import Extent
from kvfuse.fusion.engine.sequence import RequestId, Sequence

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvfuse.config import ServerSettings

    IngestPiece = Callable[[int], object | None]  # a turn of ingestion within a token budget: its result when done
    IngestNeed = Callable[[int], int]  # the KV tokens the next piece within a budget holds while it runs


class InFlight:
    """What an ingestion piece returns when it paused between decoder layers (its forward cut into
    slices, kvfuse/fusion/layer_pause.py): the job goes on with the same piece on its next turn, and
    the piece's memory stays reserved until then."""

    def __repr__(self) -> str:
        return "IN_FLIGHT"


IN_FLIGHT = InFlight()


class Phase(StrEnum):
    """Where a request is in the engine: WAITING -> PREFILLING -> DECODING, or INGESTING."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    INGESTING = "ingesting"


@dataclass(frozen=True)
class SchedulerLimits:
    """The scheduler's limits; their defaults are declared once, in config.ServerSettings."""

    max_running: int
    kv_budget_tokens: int
    prefill_tokens_per_step: int
    ingest_share: float

    @classmethod
    def from_settings(cls, server: ServerSettings) -> SchedulerLimits:
        """From kvfuse.config.ServerSettings."""
        return cls(max_running=server.max_running_requests, kv_budget_tokens=server.kv_budget_tokens,
                   prefill_tokens_per_step=server.prefill_tokens_per_step, ingest_share=server.ingest_step_share)


@dataclass(eq=False)
class Request:
    """One unit of work: a query (`seq`: waiting, then running) or an ingestion job (`piece`)."""

    job_id: RequestId
    kv_tokens: int = 0  # cache tokens held while running: prompt + max_tokens
    prefill_tokens: int = 0  # prefill work on admission (an estimate in tokens)
    seq: Sequence | None = None
    piece: IngestPiece | None = None
    need: IngestNeed | None = None  # an ingestion job's: what its next piece's forward holds on the device
    stop: Callable[[], None] | None = None  # an ingestion job's: abandon its piece in flight (cancelled)
    held: int = 0  # an ingestion job's: KV tokens its piece in flight holds between its turns (IN_FLIGHT)
    status: Phase = Phase.WAITING
    extent: Extent | None = None  # while running
    rows: int = 1  # choices decoded from its one prefill (OpenAI's n), each holding kv_tokens
    forks: list[Request] = field(default_factory=list)  # rows 1..n-1, reserved at admission until forked
    preemptible: bool = False  # the lowest class (the module docstring): admitted last, preempted first
    preemptions: int = 0  # times it was preempted and put back
    load_tokens: int = 0  # transient KV its load needs beside its extent, held from admission (`requeue`)
    announced: bool = False  # its Admitted output went out (once, however often it is admitted)


@dataclass
class StepPlan:
    admit: list[Request] = field(default_factory=list)  # now running: prefill them, then decode with the rest
    ingest: Request | None = None  # run a piece of this ingestion job (up to `ingest_tokens` tokens)
    ingest_tokens: int = 0
    ingest_kv: int = 0  # KV tokens the piece holds in the memory while it runs (its forward's cache)
    preempted: list[Request] = field(default_factory=list)  # preemptible requests sent back to wait: reset them
    low_prefill: bool = False  # whether preemptible requests get the prefill budget the queries leave
    busy: bool = False  # whether queries need the worker this step (ingestion then runs within its share)
