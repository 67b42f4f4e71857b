"""What the API and the `kvfuse worker`s of a fleet share in Redis: key names, worker heartbeats, the
fleet's model fingerprint. Both ends import this module, so they agree on every key.

Layout, under `fleet.namespace` (docs/DESIGN.md, "Scale-out")
  jobs              stream: jobs any worker may take (consumer group `workers`)
  jobs:<worker>     stream: queries routed to that worker (dispatch/routing.py; its own consumer group `workers`)
  reply:<uid>       stream: one job's Taken / Plan / Delta / Result / Done / Error entries; it expires
                    `reply_ttl_s` after its reader last renewed it (a job whose reply stream is gone is
                    dropped by its worker)
  cancel:<uid>      string: the API cancelled the job
  worker:<id>       string, TTL `heartbeat_ttl_s`: the worker's heartbeat (JSON: fingerprint, device,
                    free KV budget, load, tier counters)
  workers           set: every worker id that registered (a member without heartbeat is dead)
  holds:<id>        set: chunk keys the worker holds in RAM or LMDB (locality), expiring with it
  fingerprint       string, TTL: the model fingerprint of the live workers; a worker with another is refused
  kv:...            the shared chunk KV tier (kvfuse.store.shared_tier)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

GROUP = "workers"


@dataclass(frozen=True)
class FleetKeys:
    ns: str

    @property
    def jobs(self) -> str:
        return f"{self.ns}:jobs"

    def direct(self, worker: str) -> str:
        return f"{self.ns}:jobs:{worker}"

    def reply(self, uid: str) -> str:
        return f"{self.ns}:reply:{uid}"

    @property
    def shadow(self) -> str:
        """Shadow-check verdicts of every worker (worker/shadow.py), read by the API's fidelity ledger."""
        return f"{self.ns}:shadow"

    def cancel(self, uid: str) -> str:
        return f"{self.ns}:cancel:{uid}"

    def heartbeat(self, worker: str) -> str:
        return f"{self.ns}:worker:{worker}"

    @property
    def workers(self) -> str:
        return f"{self.ns}:workers"

    def holds(self, worker: str) -> str:
        return f"{self.ns}:holds:{worker}"

    @property
    def fingerprint(self) -> str:
        return f"{self.ns}:fingerprint"

    @property
    def shared_kv(self) -> str:
        return f"{self.ns}:kv"


def shared_tier(settings: Any) -> Any:
    """The fleet's shared chunk KV tier in Redis (kvfuse.store.shared_tier), as the API and every worker
    open it; None when `fleet.shared_tier_mb` is 0, or when an object store is configured (it is then the
    shared tier: kvfuse.store.object_tier) unless `fleet.redis_kv_with_object_store` keeps Redis above it."""
    from kvfuse.store.redis_access import RedisAccess
    from kvfuse.store.shared_tier import RedisTier

    f = settings.fleet
    if not f.shared_tier_mb or (settings.object_store.url and not f.redis_kv_with_object_store):
        return None
    return RedisTier(RedisAccess.of(settings), FleetKeys(f.namespace).shared_kv, f.shared_tier_mb << 20)


class FingerprintMismatch(RuntimeError):
    """A worker's model differs from the fleet's: its KV and answers would not match the others'."""


def read_heartbeats(r: Any, keys: FleetKeys) -> dict[str, dict]:
    """Heartbeats of the live workers, by id (a synchronous redis client)."""
    ids = sorted(r.smembers(keys.workers))
    if not ids:
        return {}
    beats = r.mget([keys.heartbeat(i) for i in ids])
    return {i: json.loads(b) for i, b in zip(ids, beats, strict=True) if b is not None}


async def read_heartbeats_async(r: Any, keys: FleetKeys) -> dict[str, dict]:
    """`read_heartbeats` for an asyncio redis client."""
    ids = sorted(await r.smembers(keys.workers))
    if not ids:
        return {}
    beats = await r.mget([keys.heartbeat(i) for i in ids])
    return {i: json.loads(b) for i, b in zip(ids, beats, strict=True) if b is not None}
