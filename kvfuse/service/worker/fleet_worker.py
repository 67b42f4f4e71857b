"""`kvfuse worker`: a model worker of a fleet, on any host, joined to the API through Redis only.

It is the worker of core.py (the same engine core, the same step) behind another transport: Redis
streams instead of a pipe (docs/DESIGN.md, "Scale-out"; the keys are in fleet.py):

- it registers with a heartbeat (a key with a TTL naming its model fingerprint, device, free KV budget,
  load and tier counters), renewed by a thread so a long engine step never makes it look dead; a worker
  whose model fingerprint differs from the fleet's is refused (FingerprintMismatch, exit code 3);
- it takes jobs from its own stream (the API routed them to it) and from the shared stream, as a consumer
  of the group `workers`, only as many as it can run, so an idle worker takes the next shared job (the
  least loaded serves); each job's messages go to its reply stream (codec.py), and the job is
  acknowledged (XACK) when its final message is out;
- it renews the idle time of the entries it holds with each heartbeat, so an entry idle longer than a
  heartbeat TTL belongs to a dead worker: it claims those back (XAUTOCLAIM, and reads what was left in
  a dead worker's own stream), re-runs a job that had sent no token, and ends one that had with an
  Error (`worker_lost`); a job that already failed over once is not run a third time;
- a job whose reply stream expired (its API went away) or that was cancelled is dropped.

Chunk KV: hot RAM -> this host's LMDB -> the shared Redis tier -> rebuild from token ids
(kvfuse.store.shared_tier); a precompute writes the host's LMDB and the shared tier.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvfuse.config import Settings
from kvfuse.service.wire import protocol as P
from kvfuse.service.wire.codec import CodecError, decode, encode
from kvfuse.service.wire.fleet_keys import GROUP, FingerprintMismatch, FleetKeys, read_heartbeats, shared_tier
from kvfuse.service.worker.core import WorkerCore
from kvfuse.store.redis_access import RedisAccess

log = logging.getLogger("kvfuse.worker")

_SHADOW_STREAM_LEN = 10_000  # verdicts kept in the shadow stream for an API that reads late
_IDLE_BLOCK_MS = 250  # how long an idle worker waits on its streams before its housekeeping
_HOLDS_TTL_FACTOR = 60  # the locality set outlives a heartbeat by this factor (it is only a hint)


@dataclass
class Route:
    """Where a job came from and where its messages go."""

    uid: str
    reply: str
    stream: str
    entry_id: str
    api_id: int
    tokens: bool = False


class FleetWorker:
    """The fleet's transport around a WorkerCore (`self.worker`)."""

    def __init__(self, settings: Settings) -> None:
        import redis

        if not settings.redis_url:
            raise ValueError("kvfuse worker needs redis_url (KVFUSE_REDIS_URL)")
        self._redis = redis
        self.fleet = settings.fleet
        self.keys = FleetKeys(settings.fleet.namespace)
        self.access = RedisAccess.of(settings)
        self.r = self.access.client(decode_responses=True, read_timeout=False)
        self.routes: dict[int, Route] = {}
        self._next_id = 0
        self._out: list[tuple[str, dict]] = []
        self._shadow_out: list[dict] = []  # shadow-check verdicts for the fleet's shadow stream
        self._done: list[int] = []
        self._holds: set[str] = set()
        self._stop = threading.Event()
        self.started_at = time.time()
        self.settings = settings
        # A chunk of a fleet is everybody's: one rebuilt on a miss goes to the tiers for other hosts.
        self.worker = WorkerCore(settings, self.send, store=self.open_store(settings), share_rebuilt=True)
        self.name = self.worker.name
        self.ttl_ms = int(self.fleet.heartbeat_ttl_s * 1000)

    # -- the store: the host's LMDB (its own embedded index) over the shared tier ----------------------------
    def open_store(self, settings: Settings) -> Any:
        from kvfuse.store import KVStore

        # The document index belongs to the API; this host's LMDB is a chunk cache with an embedded index.
        return KVStore.open(settings.model_copy(update={"redis_url": ""}), shared=shared_tier(settings))

    def kv_stats(self) -> dict:
        out = {f"hits_{k}": v for k, v in self.worker.store.chunks.hits.items()} | {"rebuilt": self.worker.kv.rebuilt}
        if self.worker.store.shared is not None:
            out |= self.worker.store.shared.stats()
        return out

    def beat(self) -> dict:
        sch, lim = self.worker.scheduler, self.worker.scheduler.limits
        return {"id": self.name, "host": socket.gethostname(), "pid": os.getpid(),
                "device": self.settings.model.device, "fingerprint": self.worker.engine.fingerprint,
                "kv_budget_tokens": sch.capacity, "kv_free_tokens": sch.capacity - sch.kv_used,
                "kv_pool_bytes": self.worker.core.memory.extent_bytes, "kv_budget_bytes": self.worker.core.memory.nbytes,
                "running": sch.num_running - sch.num_low_running, "shadow": sch.num_low_running,
                "waiting": sch.num_waiting, "jobs": len(self.routes),
                "max_running_requests": lim.max_running, "started_at": self.started_at, "info": self.worker.info(),
                "kv": self.kv_stats(), "kv_ledger": self.worker.core.ledger.report().as_dict()}

    # -- registration and heartbeat --------------------------------------------------------------------------
    def register(self) -> None:
        fp, k = self.worker.engine.fingerprint, self.keys
        others = {w["fingerprint"] for w in read_heartbeats(self.r, k).values()} - {fp}
        if not self.r.set(k.fingerprint, fp, nx=True, px=self.ttl_ms):
            fleet = self.r.get(k.fingerprint)
            if fleet is not None and fleet != fp:
                others.add(fleet)
        if others:
            raise FingerprintMismatch(
                f"this worker's model fingerprint {fp[:16]} differs from the fleet's ({', '.join(sorted(others))}): "
                "every worker of a fleet must run the same model, dtype and tokenizer")
        for stream in (k.jobs, k.direct(self.name)):
            try:
                self.r.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except self._redis.ResponseError as err:
                if "BUSYGROUP" not in str(err):
                    raise
        self._beat_once(self.r)
        log.info("worker %s joined the fleet %s (model %s, device %s)", self.name, self.fleet.namespace, fp[:16],
                 self.settings.model.device)

    def _beat_once(self, r: Any) -> None:
        k, fp = self.keys, self.worker.engine.fingerprint
        held: dict[str, list[str]] = {}
        for route in list(self.routes.values()):
            held.setdefault(route.stream, []).append(route.entry_id)
        pipe = r.pipeline(transaction=False)
        pipe.set(k.heartbeat(self.name), json.dumps(self.beat()), px=self.ttl_ms)
        pipe.sadd(k.workers, self.name)
        pipe.set(k.fingerprint, fp, nx=True, px=self.ttl_ms)
        pipe.get(k.fingerprint)
        pipe.pexpire(k.holds(self.name), self.ttl_ms * _HOLDS_TTL_FACTOR)
        for stream, ids in held.items():  # still ours: keeps them from looking abandoned
            pipe.xclaim(stream, GROUP, self.name, 0, ids, justid=True)
        res = pipe.execute(raise_on_error=False)
        if res[3] == fp:
            r.pexpire(k.fingerprint, self.ttl_ms)
        else:
            log.error("the fleet's model fingerprint is now %s, not this worker's %s", res[3], fp[:16])

    def _heartbeat(self) -> None:
        r = self.access.client(decode_responses=True)
        while not self._stop.wait(self.fleet.heartbeat_s):
            try:
                self._beat_once(r)
            except (self._redis.RedisError, RuntimeError) as err:  # RuntimeError: routes changed mid-copy
                log.warning("heartbeat failed: %s", err)

    # -- jobs in ---------------------------------------------------------------------------------------------
    def capacity(self) -> int:
        return max(0, self.worker.scheduler.limits.max_running - len(self.routes))

    def take(self, stream: str, entry_id: str, fields: dict, *, checked: bool = False) -> None:
        """Start a job read from `stream` (dropped when its requester is gone or it was cancelled)."""
        try:
            msg = decode(fields)
            uid = fields["uid"]
        except (CodecError, KeyError) as err:
            log.error("dropping a malformed job entry %s: %s", entry_id, err)
            self.r.xack(stream, GROUP, entry_id)
            return
        if not isinstance(msg, P.QueryJob | P.PrecomputeJob):
            self.r.xack(stream, GROUP, entry_id)
            return
        reply = self.keys.reply(uid)
        if not checked:
            alive, cancelled = self.r.exists(reply), self.r.exists(self.keys.cancel(uid))
            if not alive or cancelled:
                self.r.xack(stream, GROUP, entry_id)
                return
        self._next_id += 1
        local = self._next_id
        self.routes[local] = Route(uid, reply, stream, entry_id, msg.job_id)
        self._out.append((reply, {"t": "Taken", "w": self.name}))
        msg.job_id = local
        if isinstance(msg, P.QueryJob):
            self._holds.update(c.key for c in msg.chunks)
        self.worker.receive(msg)

    def adopt(self, stream: str, entry_id: str, fields: dict | None) -> None:
        """A job claimed back from a dead worker: run again if it sent no token, else ended cleanly."""
        uid = (fields or {}).get("uid")
        if uid is None:
            self.r.xack(stream, GROUP, entry_id)
            return
        reply = self.keys.reply(uid)
        pipe = self.r.pipeline(transaction=False)
        pipe.exists(reply)
        pipe.exists(self.keys.cancel(uid))
        pipe.xrange(reply)
        alive, cancelled, entries = pipe.execute()
        if not alive or cancelled:
            self.r.xack(stream, GROUP, entry_id)
            return
        kinds = [f.get("t") for _, f in entries]
        tokens, takes = "Delta" in kinds, kinds.count("Taken")
        dead = next((f.get("w") for _, f in reversed(entries) if f.get("t") == "Taken"), "?")
        if tokens or takes >= 2:
            why = (f"the worker {dead} serving this request died after it had started answering" if tokens
                   else f"the job was running on two workers that died (the last {dead}): it is not run again")
            try:
                api_id = json.loads(fields["d"]).get("job_id", 0)
            except (KeyError, ValueError):
                api_id = 0
            log.warning("job %s of a dead worker ended: %s", uid, why)
            self.r.xadd(reply, encode(P.Error(api_id, P.ERR_WORKER_LOST, why)), nomkstream=True)
            self.r.xack(stream, GROUP, entry_id)
            return
        log.warning("re-running job %s of a dead worker", uid)
        self.take(stream, entry_id, fields, checked=True)

    def reclaim(self) -> None:
        """Claim back the jobs of dead workers (see the module docstring)."""
        k = self.keys
        _, claimed, *_ = self.r.xautoclaim(k.jobs, GROUP, self.name, min_idle_time=self.ttl_ms, start_id="0-0",
                                           count=max(1, self.capacity()))
        for entry_id, fields in claimed:
            self.adopt(k.jobs, entry_id, fields)
        for wid in self.r.smembers(k.workers):
            if wid == self.name or self.r.exists(k.heartbeat(wid)):
                continue
            stream = k.direct(wid)
            if self.r.exists(stream):
                _, claimed, *_ = self.r.xautoclaim(stream, GROUP, self.name, min_idle_time=0, start_id="0-0",
                                                   count=100)
                unread = self.r.xreadgroup(GROUP, self.name, {stream: ">"}, count=100) or []
                for entry_id, fields in [*claimed, *(e for _, es in unread for e in es)]:
                    self.adopt(stream, entry_id, fields)
                if self.r.xpending(stream, GROUP)["pending"] > len([r for r in self.routes.values()
                                                                    if r.stream == stream]):
                    continue  # another worker is adopting from it too
            log.info("worker %s is gone: its jobs were claimed back", wid)
            self.r.delete(stream, k.holds(wid))
            self.r.srem(k.workers, wid)

    def check_cancels(self) -> None:
        items = list(self.routes.items())
        pipe = self.r.pipeline(transaction=False)
        for _, route in items:
            pipe.exists(self.keys.cancel(route.uid))
            pipe.exists(route.reply)
        res = pipe.execute()
        for i, (local, _) in enumerate(items):
            if res[2 * i] or not res[2 * i + 1]:
                self.worker.receive(P.Cancel(local))
                if local not in self._done:
                    self._done.append(local)

    # -- messages out ----------------------------------------------------------------------------------------
    def send(self, msg: Any) -> None:
        if isinstance(msg, P.Step | P.Ready | P.Fatal):
            return  # the heartbeat carries the load
        if isinstance(msg, P.SHADOW):  # outlives its job: the fleet's own stream, not the job's replies
            msg.worker = self.name
            self._shadow_out.append(encode(msg, w=self.name))
            return
        route = self.routes.get(getattr(msg, "job_id", -1))
        if route is None:
            return
        if isinstance(msg, P.Result | P.Done):
            msg.worker = self.name
        if isinstance(msg, P.Done):
            self._holds.update(msg.keys)
        if isinstance(msg, P.Delta):
            route.tokens = True
        self._out.append((route.reply, encode(dataclasses.replace(msg, job_id=route.api_id), w=self.name)))
        if isinstance(msg, P.FINAL):
            self._done.append(msg.job_id)

    def flush(self) -> None:
        if not (self._out or self._done or self._holds or self._shadow_out):
            return
        pipe = self.r.pipeline(transaction=False)
        for fields in self._shadow_out:
            pipe.xadd(self.keys.shadow, fields, maxlen=_SHADOW_STREAM_LEN, approximate=True)
        for key, fields in self._out:
            pipe.xadd(key, fields, nomkstream=True)  # never re-creates the stream of a reader gone
        for local in self._done:
            route = self.routes.pop(local, None)
            if route is not None:
                pipe.xack(route.stream, GROUP, route.entry_id)
        if self._holds:
            pipe.sadd(self.keys.holds(self.name), *self._holds)
        self._out, self._done, self._holds, self._shadow_out = [], [], set(), []
        pipe.execute(raise_on_error=False)

    # -- the loop --------------------------------------------------------------------------------------------
    def serve(self, on_joined: Any = None) -> None:
        """Take and run jobs until stopped; `on_joined()` once registered (health.py: ready)."""
        self.register()
        threading.Thread(target=self._heartbeat, name="kvfuse-heartbeat", daemon=True).start()
        if on_joined is not None:
            on_joined()
        k = self.keys
        streams = {k.direct(self.name): ">", k.jobs: ">"}
        last_reclaim = 0.0
        deadline = None
        while True:
            if self._stop.is_set():  # finish what runs, take nothing new
                deadline = deadline or time.monotonic() + self.settings.server.worker_stop_timeout_s
                if not self.routes or time.monotonic() > deadline:
                    return
            try:
                busy = self.worker.has_work  # shadow checks included: poll, never block
                free = 0 if self._stop.is_set() else self.capacity()
                if free:
                    got = self.r.xreadgroup(GROUP, self.name, streams, count=free,
                                            block=None if busy else _IDLE_BLOCK_MS) or []
                    for stream, entries in got:
                        for entry_id, fields in entries:
                            self.take(stream, entry_id, fields)
                elif not busy:
                    time.sleep(_IDLE_BLOCK_MS / 1000)
                if free and time.monotonic() - last_reclaim > self.fleet.heartbeat_s:
                    last_reclaim = time.monotonic()
                    self.reclaim()
                if self.routes:
                    self.check_cancels()
                self.flush()
                if self.worker.has_work:
                    self.worker.step()
                self.flush()
            except self._redis.RedisError as err:
                if "NOGROUP" in str(err):  # taken for dead after a long stall: its own stream went; join again
                    log.error("this worker's job stream was claimed by the fleet: registering again")
                    with contextlib.suppress(self._redis.RedisError, FingerprintMismatch):
                        self.register()
                    continue
                log.error("Redis failed (%s): retrying in 1 s", err)
                time.sleep(1.0)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(self._redis.RedisError):
            self.r.delete(self.keys.heartbeat(self.name))
        self.worker.store.close()


def worker_command(settings: Settings) -> int:
    """`kvfuse worker`: serve until SIGTERM / SIGINT (running jobs finish first, within
    server.worker_stop_timeout_s); exit code 3 when the fleet runs another model. Its state (starting,
    ready, failed) is in a status file for `kvfuse worker --health`; a model that fails every one of
    server.worker_start_attempts loads leaves it failed until stopped (exit code 1; kvfuse/service/health.py)."""
    from kvfuse.service.health import READY, WorkerStatus, start_with_retries, wait_failed

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s worker: %(message)s")
    status = WorkerStatus(settings.data_dir, settings.fleet.worker_name or f"{socket.gethostname()}-{os.getpid()}")
    worker = start_with_retries(lambda: FleetWorker(settings), settings.server.worker_start_attempts, status)
    if worker is None:
        return wait_failed(status)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker._stop.set())
    try:
        worker.serve(on_joined=lambda: status.set(READY))
    except FingerprintMismatch as err:
        log.error("REFUSED: %s", err)
        print(f"kvfuse worker: refused: {err}", file=sys.stderr)
        return 3
    finally:
        worker.close()
        status.remove()
    return 0
