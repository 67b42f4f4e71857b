"""Which requests the engine runs in each step: policy over the KV memory, no process, pipe or model code.

The shape is nano-vllm's `engine/scheduler.py`: a waiting queue and a running set. Each step the engine
core asks `schedule()` what to do, runs it (the fused prefill of the admitted requests, an ingestion
piece, then one batched decode step for every running sequence) and reports back with `retire()`.

Admission is bounded three ways, so neither memory nor a burst of arrivals can hurt the running streams:
- KV memory: a request is admitted only when the KV memory (`kv_memory.KVMemory`) can give it an extent
  for prompt + max_tokens tokens, and it holds that extent until it retires: admission asks the memory
  that holds the bytes, not a count kept beside it, so what is allocated never exceeds the budget. A
  request that does not fit waits. One whose cache is evicted after its first token
  (`fusion.evict_capacity`) or built sparse gives the rest of its extent back then. One whose load
  needs room beside its extent that the memory cannot count (ledger.NeedsRoom: cold chunks computed at
  first use) goes back to the head of the queue (`requeue`) and is admitted again with that room too.
- Batch size: at most `max_running` sequences decode together.
- Prefill work: a request is admitted only while the prefill work of the admitted requests that are
  still prefilling stays within `prefill_tokens_per_step` (or none is), and the worker runs at most
  that much prefill per step (a fused prefill pauses between decoder layers, `FusionEngine.fuse_steps`),
  so a long prompt delays the running streams by a bounded amount per step, not by its whole length.
A request for n choices (`rows`) is admitted whole or not at all: n extents of prompt + max_tokens each
and n of the `max_running` slots, reserved together at admission (`forks`), so its choices never wait
for memory after its prefill; the core forks them into running rows when the prefill completes (`fork`).
Admission is first come, first served: the head of the queue is never overtaken, so a large request
cannot starve behind a stream of small ones.

Ingestion (chunk KV precompute) shares the worker under one rule: queries first, but while ingestion
work is pending it is guaranteed `ingest_share` of the worker's time while queries are active (a credit
in seconds that the queries' measured step time earns and each piece spends: `spent`; a share of steps
would give it more, its pieces being longer than decode steps), and every step when no query needs the
worker. A piece's forward runs a few decoder layers per turn (`server.ingest_layers_per_step`; the
piece returns IN_FLIGHT until its last), so what it spends, and what a query arriving meanwhile waits
for, is a slice of layers, not a whole forward. So a large ingest neither blocks readers nor starves. A piece's forward holds a cache
of its own (the model's, of a padded batch): it is reserved in the KV memory for the piece's run
(`Request.need`, held from its first slice to its last: `Request.held`), so a piece waits for a step
whose memory has room beside the running requests.

Preemptible requests (the shadow checks' full prefills, kvfuse/service/worker/shadow.py) are the lowest
class, as vLLM v1's priority scheduling and nano-vllm's preemption treat a request that may be
redone: one is admitted only while no query waits, holds its extent in the same KV memory (so the
budget counts it), gets the prefill budget a step's queries left over (none in a step that runs an
ingestion piece), and never counts as query work for ingestion's share. When a waiting query needs the
memory or the batch row one holds, it is preempted (newest first): its extent is freed at once and it
goes back to the head of its queue, to be recomputed from the start later (vLLM's recompute
preemption; `StepPlan.preempted` tells the core to reset its Sequence). So a query arriving during
such work waits for at most the rest of one engine step.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque

from kvfuse.fusion.engine.kv_memory import KVMemory, MemoryFull
from kvfuse.fusion.engine.requests import Phase, Request, SchedulerLimits, StepPlan
from kvfuse.fusion.engine.sequence import RequestId


class Scheduler:
    """memory: the kv_memory.KVMemory running requests hold their extents in."""

    def __init__(self, limits: SchedulerLimits, memory: KVMemory) -> None:
        self.limits = limits
        self.memory = memory
        self.capacity = memory.free_tokens  # what one request may hold at most (the memory minus any reserve)
        self.waiting: deque[Request] = deque()
        self.running: OrderedDict[RequestId, Request] = OrderedDict()
        self.ingest: deque[Request] = deque()
        self.low: deque[Request] = deque()  # preemptible requests waiting (the preempted at the head)
        self.preemptions = 0  # since start
        self.prefill_pending = 0  # prefill tokens of running requests whose prefill is not complete
        self._credit = 0.0  # seconds of ingestion the queries' time since the last piece has earned (`spent`)
        self._piece_s: float | None = None  # the last ingestion piece's seconds: what the next is taken to cost
        self.row_ids = itertools.count(-1, -1)  # forked rows' and private work's ids: negative, apart from the jobs'

    # -- state ----------------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.ingest or self.low)

    @property
    def kv_used(self) -> int:
        """KV tokens the running requests hold: read off the memory's extents (one ledger), less what it
        reserves."""
        return self.memory.extent_tokens - (self.memory.capacity - self.capacity)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_low_running(self) -> int:
        """Running preemptible requests (shadow checks)."""
        return sum(r.preemptible for r in self.running.values())

    @property
    def rows_held(self) -> int:
        """Batch rows the running requests hold: their own and those reserved for their forks."""
        return len(self.running) + sum(len(r.forks) for r in self.running.values())

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def fits_alone(self, kv_tokens: int, rows: int = 1) -> bool:
        """Whether a request (of `rows` choices) could ever run (on an idle worker); one that cannot is
        refused, not queued."""
        if rows == 1:
            return kv_tokens <= self.capacity
        align = self.memory.align
        return rows <= self.limits.max_running and rows * (-(-kv_tokens // align) * align) <= self.capacity

    # -- arrivals and departures ------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if not self.fits_alone(req.kv_tokens, req.rows):
            raise ValueError(f"request {req.job_id} needs {req.rows} x {req.kv_tokens} KV tokens and {req.rows} "
                             f"rows, over the budget of {self.capacity} tokens and {self.limits.max_running} rows")
        if req.preemptible and req.rows != 1:
            raise ValueError("a preemptible request decodes one row")
        (self.low if req.preemptible else self.waiting).append(req)

    def add_ingest(self, req: Request) -> None:
        req.status = Phase.INGESTING
        self.ingest.append(req)

    def retire(self, job_id: RequestId) -> Request | None:
        """A running request ended (finished, cancelled or failed): its KV budget is free again."""
        req = self.running.pop(job_id, None)
        if req is not None:
            self.memory.release(job_id)
            req.extent = None
            for row in req.forks:  # reserved, never forked
                self.memory.release(row.job_id)
            req.forks = []
            self.load_starts(job_id)  # the room kept for its load, if it had not started
            if req.status is Phase.PREFILLING and not req.preemptible:
                self.prefill_pending -= req.prefill_tokens
        return req

    def requeue(self, job_id: RequestId, load_tokens: int) -> bool:
        """A running query whose load needs `load_tokens` of transient KV beside its extent, more than the
        memory can count now (ledger.NeedsRoom), goes back to the head of the queue; it is admitted again
        when its extents and that room fit together, the room held for it until its load starts. False,
        and nothing done, when they never could."""
        req = self.running.get(job_id)
        align = self.memory.align
        if req is None or req.rows * -(-req.kv_tokens // align) * align + load_tokens > self.capacity:
            return False
        self.retire(job_id)
        req.status, req.load_tokens = Phase.WAITING, max(req.load_tokens, load_tokens)
        self.waiting.appendleft(req)
        return True

    def load_starts(self, job_id: RequestId) -> None:
        """The room admission kept for a requeued query's load is given back for the load to take."""
        self.memory.unhold(_load_room(job_id))

    def prefilled(self, job_id: RequestId, kv_tokens: int | None = None) -> None:
        """A running request's prefill is complete: from now on it decodes with the batch. kv_tokens:
        the cache it holds from now on, when smaller than admitted (eviction after the first token,
        fusion/eviction.py); the difference is free for admissions at once."""
        req = self.running[job_id]
        if req.status is Phase.PREFILLING:
            req.status = Phase.DECODING
            if not req.preemptible:
                self.prefill_pending -= req.prefill_tokens
        if kv_tokens is not None and kv_tokens < req.kv_tokens:
            self.memory.shrink(job_id, kv_tokens)
            req.kv_tokens = kv_tokens
        self.memory.settle(job_id)  # no loader writes its extent any more: compaction may move it

    def fork(self, job_id: RequestId) -> list[Request]:
        """A prefilled request's reserved rows (n > 1), running from now on: each decodes with the batch
        over its own extent, cut to what the request holds now (`prefilled`). The caller gives each its
        Sequence (Sequence.fork) before the next step."""
        req = self.running[job_id]
        rows, req.forks = req.forks, []
        for row in rows:
            if row.kv_tokens > req.kv_tokens:
                self.memory.shrink(row.job_id, req.kv_tokens)
                row.kv_tokens = req.kv_tokens
            self.memory.settle(row.job_id)
            row.status = Phase.DECODING
            self.running[row.job_id] = row
        return rows

    def _reserve(self, head: Request) -> bool:
        """The head's extent and those of its other rows, all or none (False: they do not fit now)."""
        taken: list[Request] = []
        if head.rows == 1 and not self.memory.can_allocate(head.kv_tokens):
            return False
        try:
            head.extent = self.memory.allocate(head.job_id, head.kv_tokens)
            for _ in range(head.rows - 1):
                row = Request(next(self.row_ids), kv_tokens=head.kv_tokens)
                row.extent = self.memory.allocate(row.job_id, row.kv_tokens)
                taken.append(row)
        except MemoryFull:
            for r in [head, *taken]:
                self.memory.release(r.job_id)
            head.extent = None
            return False
        head.forks = taken
        return True

    def ingest_done(self, job_id: RequestId) -> None:
        self.ingest = deque(r for r in self.ingest if r.job_id != job_id)

    def remove(self, job_id: RequestId) -> Request | None:
        """Take a request out wherever it is (cancellation); its `status` says where it was."""
        for queue in (self.waiting, self.low):
            for r in queue:
                if r.job_id == job_id:
                    queue.remove(r)
                    return r
        if job_id in self.running:
            return self.retire(job_id)
        for r in self.ingest:
            if r.job_id == job_id:
                self.ingest_done(job_id)
                return r
        return None

    # -- the policy -------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """What the next step does. Admitted requests move to `running` and hold their extents; preemptible
        ones are preempted where a query needs what they hold (`plan.preempted`)."""
        lim = self.limits
        plan = StepPlan()
        while self.waiting:
            head = self.waiting[0]
            if self.prefill_pending and self.prefill_pending + head.prefill_tokens > lim.prefill_tokens_per_step:
                break
            if not self._hold(head, plan):
                break
            self.waiting.popleft()
            head.status = Phase.PREFILLING
            self.running[head.job_id] = head
            self.prefill_pending += head.prefill_tokens
            plan.admit.append(head)
        while (self.low and not self.waiting and self.rows_held < lim.max_running
               and self.memory.can_allocate(self.low[0].kv_tokens)):
            low = self.low.popleft()
            low.extent = self.memory.allocate(low.job_id, low.kv_tokens, kind="shadow")
            low.status = Phase.PREFILLING
            self.running[low.job_id] = low
            plan.admit.append(low)
        if self.ingest:
            plan.busy = bool(self.waiting or any(not r.preemptible for r in self.running.values()))
            if not plan.busy:
                plan.ingest, self._credit = self.ingest[0], 0.0
            elif lim.ingest_share >= 1.0 or (self._credit >= self._piece_s - 1e-9 if self._piece_s is not None
                                              else self._credit > 0.0):
                plan.ingest = self.ingest[0]
            if plan.ingest is not None:
                plan.ingest_tokens = lim.prefill_tokens_per_step
                self._reserve_ingest(plan)
        else:
            self._credit = 0.0
        plan.low_prefill = plan.ingest is None and not self.waiting
        return plan

    def spent(self, plan: StepPlan, ingest_s: float, other_s: float) -> None:
        """The step of `plan` took `ingest_s` seconds in its ingestion piece and `other_s` in the rest. While
        queries need the worker, ingestion's share is one of the worker's time, not of its steps: the
        queries' seconds earn share / (1 - share) seconds of ingestion, a piece spends what it took, and the
        next piece runs once the credit reaches the last one's length (banked for one piece at most). A
        piece is often several decode steps long (a chunk's whole forward against a row per stream), so a
        count of steps would give ingestion several times its share of the time."""
        if plan.ingest is not None:
            self._piece_s = ingest_s
        if not plan.busy or not self.ingest or self.limits.ingest_share >= 1.0:
            return
        share = self.limits.ingest_share
        earned = self._credit + other_s * share / (1.0 - share) - (ingest_s if plan.ingest is not None else 0.0)
        self._credit = min(earned, self._piece_s) if self._piece_s is not None else earned

    def _reserve_ingest(self, plan: StepPlan) -> None:
        """The ingestion piece's forward holds a cache of its own while it runs (the model's, of a padded
        batch): it runs only in a step whose memory can give that many tokens beside the running requests'
        (its turn kept for the first step that can; preemptible requests are preempted for it), and the
        core holds them as an extent meanwhile. One that could never fit goes ahead, and fails in the core."""
        req = plan.ingest
        assert req is not None
        if req.held:  # a piece in flight holds its memory already
            plan.ingest_kv = req.held
            return
        need = req.need(plan.ingest_tokens) if req.need is not None else 0
        if 0 < need <= self.capacity and not self.memory.can_allocate(need):
            if not self.memory.can_allocate(need, without={r.job_id for r in self._low_running()}):
                plan.ingest, plan.ingest_tokens = None, 0  # its credit kept: its turn is the next step with room
                return
            while not self.memory.can_allocate(need):  # ingestion outranks the preemptible class too
                self._preempt(self._low_running()[-1], plan)
        plan.ingest_kv = need

    def _low_running(self) -> list[Request]:
        """The running preemptible requests, oldest first."""
        return [r for r in self.running.values() if r.preemptible]

    def _hold(self, head: Request, plan: StepPlan) -> bool:
        """Give the waiting query `head` its batch rows and extents, preempting running preemptible
        requests (newest first) while they are what it waits for, and only when preempting them all would
        make the room (rows and memory; n > 1 rows counted as one extent of their sum); False: it waits."""
        low = self._low_running()
        room = {r.job_id for r in low}
        helps = bool(low) and (self.rows_held - len(low) + head.rows <= self.limits.max_running
                               and self.memory.can_allocate(head.kv_tokens * head.rows + head.load_tokens,
                                                            without=room))
        while True:
            if self.rows_held + head.rows <= self.limits.max_running and self._reserve(head):
                if not head.load_tokens or self.memory.hold(  # the room a requeued query's load asked for
                        _load_room(head.job_id), head.load_tokens * self.memory.token_bytes, "load", make_room=True):
                    return True
                for r in [head, *head.forks]:
                    self.memory.release(r.job_id)
                head.extent, head.forks = None, []
            low = self._low_running()
            if not (helps and low):
                return False
            self._preempt(low[-1], plan)

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        """Free a preemptible request's extent and send it back to wait (at the head of its queue), to be
        redone from the start."""
        self.running.pop(req.job_id)
        self.memory.release(req.job_id)
        req.extent, req.status, req.announced = None, Phase.WAITING, False  # redone: admitted anew
        req.preemptions += 1
        self.preemptions += 1
        self.low.appendleft(req)
        plan.preempted.append(req)

    def prefilling(self, low: bool = True) -> list[Request]:
        """Running requests whose prefill is not complete, in admission order (the first gets the
        step's prefill budget first), queries before preemptible requests (those only when `low`)."""
        mine = [r for r in self.running.values() if r.status is Phase.PREFILLING]
        return [r for r in mine if not r.preemptible] + ([r for r in mine if r.preemptible] if low else [])

    def decode_batch(self) -> list[Request]:
        """Every running request past its prefill, in admission order: one batched decode step covers them."""
        return [r for r in self.running.values() if r.status is Phase.DECODING]


def _load_room(job_id: RequestId) -> tuple[str, RequestId]:
    """The owner of the room kept for a requeued query's load (apart from the loads' own holds, ledger.py)."""
    return ("load room", job_id)
