"""The messages between the API process and the worker, one small dataclass each.

They cross a multiprocessing pipe (pickled), so they hold plain values only: chunk keys, token ids and
options, never KV bytes (the worker reads the store itself). One module, so both ends agree on the
shape of every message and a type checker can see it.

API -> worker: QueryJob, PrecomputeJob, Cancel, Shutdown.
Worker -> API: Ready or Fatal once at start; per job: Plan (a query was admitted), Delta (new text),
Result (a query's end), Done (a precompute's end), Error (refused or failed); Step after each engine
step (batch size and queue depths, for metrics and tests); ShadowResult / ShadowDropped when a shadow
check of a finished query ends or is dropped (worker/shadow.py: no text of the query, only what the
API's fidelity ledger counts). Every job message carries `job_id`; messages
about a job also carry the engine `step` they were produced in, so ordering can be checked without
clocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

# Error kinds the API maps to HTTP statuses (see query.QueryService.api_error).
ERR_CONTEXT_OVERFLOW = "context_overflow"   # explicit documents do not fit -> 400
ERR_MAX_TOKENS = "max_tokens_overflow"      # prompt + max_tokens alone exceed the context -> 400
ERR_KV_BUDGET = "kv_budget_exceeded"        # prompt + max_tokens alone exceed the worker's KV budget -> 400
ERR_CHOICES = "choices_exceed_budget"       # n choices together exceed the KV budget or the batch rows -> 400
ERR_INVALID = "invalid_request"             # the engine refused the options -> 422
ERR_INTERNAL = "internal"                   # anything else -> 500
ERR_WORKER_LOST = "worker_lost"             # a fleet worker died after the answer had started -> 503
ERR_INDEX_UNAVAILABLE = "index_unavailable"  # the worker's store could not reach its index (Redis) -> 503


class JobStatus(StrEnum):
    """Where a job stands in its life, one vocabulary for both sides of the seam. The API's `Job`
    (dispatch/job_book.py) sees WAITING -> RUNNING -> an end; the worker's `Request`
    (worker/scheduler.py) sees the running part finer: PREFILLING -> DECODING for a query, INGESTING for
    a precompute. FINISHED, CANCELLED and FAILED are ends."""

    WAITING = "waiting"  # submitted, not admitted yet
    RUNNING = "running"  # admitted by the worker (the API's view: its Plan or first step came)
    PREFILLING = "prefilling"  # worker: admitted, its fused prefill not complete
    DECODING = "decoding"  # worker: its first token is out; it decodes with the batch
    INGESTING = "ingesting"  # worker: a precompute, run a piece at a time between query steps
    FINISHED = "finished"  # its final message came (Result or Done)
    CANCELLED = "cancelled"  # cancelled by the client (or the service) before its end
    FAILED = "failed"  # refused or failed (Error), or its worker died

    @property
    def ended(self) -> bool:
        return self in (JobStatus.FINISHED, JobStatus.CANCELLED, JobStatus.FAILED)


# -- API -> worker ---------------------------------------------------------------------------------------
@dataclass
class ChunkRef:
    key: str
    token_ids: list[int]
    score: float = 1.0
    # its document's name in the labelled prompt (kvfuse/fusion/prompt.py); "" for the plain prompt
    name: str = ""
    # the tokens its KV is computed after ([] = alone; None = not known): a chunk in no tier is computed
    # after them, as ingestion computes it (service/rag/precompute_context.py, `recorded_contexts`)
    context: list[int] | None = field(default_factory=list)


@dataclass
class QueryJob:
    question: str
    system_prompt: str | None
    explicit: bool  # the caller chose the documents: overflow is an error, not a reason to drop chunks
    fusion: dict[str, Any]
    generation: dict[str, Any]
    chunks: list[ChunkRef]
    job_id: int = 0  # assigned by the supervisor
    history: list[list[str]] = field(default_factory=list)  # earlier turns, [role, text] oldest first
    n: int = 1  # choices decoded from the one fused prefill (OpenAI's n; engine/sequence.py)


@dataclass
class PrecomputeJob:
    chunks: list[list[int]]
    job_id: int = 0
    # per chunk, the tokens its KV is computed after ([] or none given: alone); see service/rag/precompute_context.py
    contexts: list[list[int]] = field(default_factory=list)
    # a warm-up of stored documents (service/rag/warmup.py): write a chunk only while a document refers to it
    referenced_only: bool = False

    def context(self, i: int) -> list[int]:
        return self.contexts[i] if self.contexts else []


@dataclass
class Cancel:
    job_id: int


@dataclass
class Shutdown:
    job_id: int = 0



# -- worker -> API ---------------------------------------------------------------------------------------
@dataclass
class Ready:
    info: dict[str, Any]


@dataclass
class Fatal:
    message: str


@dataclass
class Plan:
    job_id: int
    kept: list[int]
    dropped: list[int]
    context_tokens: int
    prefix_tokens: int
    question_tokens: int
    step: int = 0
    method: str | None = None  # the method that runs when it is not the request's (fusion.cold_chunks)


@dataclass
class Delta:
    job_id: int
    text: str
    step: int = 0
    # with generation["logprobs"] set: per token kept since the last Delta, [id, logprob, [[id, logprob]...]]
    logprobs: list | None = None
    index: int = 0  # the choice whose text this is (QueryJob.n > 1)


@dataclass
class Result:
    job_id: int
    text: str
    finish_reason: str
    usage: dict[str, int]
    timings: dict[str, float]
    rebuilt_chunks: int = 0
    step: int = 0
    worker: str = ""  # the worker that served it (named in the answer)
    logprobs: list | None = None  # every kept token's, as in Delta, when asked for
    # Chunks of this query served by each store tier ("device", "hot", "lmdb", ...; "miss": none had it),
    # the device tier's bytes after it, and per tier "bytes:<tier>" held and "evictions:<tier>" so far
    # (kvfuse_kv_tier_* metrics)
    kv_reads: dict[str, int] = field(default_factory=dict)
    # QueryJob.n > 1: choices 1..n-1, each {"index", "text", "finish_reason", "logprobs", "generated_tokens"};
    # text / finish_reason / logprobs above are choice 0's, usage["generated_tokens"] the sum over all
    choices: list[dict] = field(default_factory=list)


def prompt_tokens(usage: dict[str, int]) -> int:
    """The prompt tokens of a Result's `usage`: system prefix, documents and question."""
    return usage.get("prefix_tokens", 0) + usage.get("context_tokens", 0) + usage.get("question_tokens", 0)


@dataclass
class Done:
    job_id: int
    keys: list[str]
    nbytes: list[int]
    computed: int
    step: int = 0
    worker: str = ""


@dataclass
class Error:
    job_id: int
    kind: str
    message: str
    excess_tokens: int | None = None
    step: int = 0


@dataclass
class Step:
    """One engine step: what it did and the queues after it."""

    step: int
    batch_size: int  # sequences in this step's batched decode (0: no decode)
    admitted: list[int] = field(default_factory=list)
    ingest_job: int | None = None  # the precompute job that got a share of this step
    running: int = 0
    waiting: int = 0
    kv_tokens: int = 0
    kv_bytes: int = 0  # KV memory held by the running sequences' extents
    seconds: float = 0.0  # the step's wall time in the worker (kvfuse_engine_step_seconds)
    shadow: int = 0  # running shadow checks' rows (not in `running`)
    ledger: dict[str, int] = field(default_factory=dict)  # device KV bytes by holder (engine/ledger.py)
    ledger_peak: int = 0  # the most device KV bytes the worker's ledger read in this step


@dataclass
class ShadowResult:
    """A shadow check's verdict (worker/shadow.py): the fused answer against a full prefill of the same
    prompt. Counts only: no text or token of the query crosses back."""

    method: str
    recompute_ratio: float
    context_tokens: int  # the prompt's documents, for the size bucket
    agreed: bool | None  # greedy answers agree under fidelity.metric; None: the fused answer was sampled
    answer_kl: float  # mean KL(P_full ‖ P_fused) over the fused answer's tokens, in nats
    answer_tokens: int
    slices: int = 0  # engine steps the check ran in (on the engine core, redone ones included)
    max_slice_work: int = 0  # the check's largest work in one step, rows x layers (what a live request waits)
    step: int = 0
    worker: str = ""


@dataclass
class ShadowDropped:
    """A finished query's shadow check was dropped before it ran: the pending checks were as many as
    fidelity.shadow_queue, or held fidelity.shadow_memory_mb, so the oldest went (or it could never fit
    the KV memory, server.kv_budget_tokens, which holds a check's full prefill too)."""

    method: str
    step: int = 0
    worker: str = ""


FINAL = (Result, Done, Error)
SHADOW = (ShadowResult, ShadowDropped)

