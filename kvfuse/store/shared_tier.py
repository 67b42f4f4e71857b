"""The shared chunk KV tier in Redis: what one host computed, every host can read.

The lowest storage tier of a fleet worker's `TieredStore` (chunk_store.py): hot RAM -> the host's LMDB
-> this tier -> rebuild from the chunk's token ids. Keys are the content keys of kvfuse.kvblob (they
already include the model fingerprint and the KV dtype), so hosts running the same model share entries
and a host with another model can never read them.

Layout, under `<prefix>:`
  blob:<key>    the chunk's blob, exactly as LMDB keeps it (kvfuse.kvblob, checksummed)
  meta:<key>    JSON {bytes, tokens, checksum, created_at}; written last
  bytes         the running total of blob bytes (what the cap is checked against)

A reader trusts a blob only through its metadata key: no `meta` means no entry, whatever `blob` holds,
and a blob whose length or checksum disagrees with `meta` is damaged (CorruptBlobError; the caller
rebuilds it). A put writes blob, meta and the total in one server-side script, so a half-written blob is
never visible and two hosts storing the same chunk add it once.

When full: a put that would take the total past `cap_bytes`, or that Redis itself refuses (maxmemory),
is not added, and the chunk stays in the LMDB of the host that computed it; other hosts rebuild it from
its token ids. Entries are never evicted by this tier: they go when the last document using them is
deleted (the API's catalog, remote_blobs.py) or when an operator flushes the prefix. See
docs/DESIGN.md, "Scale-out".
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid

from kvfuse.kvblob import CorruptBlobError, decode, pack
from kvfuse.store.chunk_store import ChunkStore, Entry
from kvfuse.store.errors import IndexUnavailableError
from kvfuse.store.redis_access import RedisAccess

log = logging.getLogger(__name__)
PROBE_BYTES = 256 << 10  # what a worker reads through this tier at start to measure it

_PUT = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
local used = tonumber(redis.call('GET', KEYS[3]) or '0')
if used + tonumber(ARGV[3]) > tonumber(ARGV[4]) then return -1 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[2])
redis.call('INCRBY', KEYS[3], ARGV[3])
return 1
"""

_REMOVE = """
local meta = redis.call('GET', KEYS[2])
redis.call('DEL', KEYS[1], KEYS[2])
if not meta then return 0 end
redis.call('DECRBY', KEYS[3], cjson.decode(meta)['bytes'])
return 1
"""


class RedisTier(ChunkStore):
    name = "shared"

    def __init__(self, where: RedisAccess | str, prefix: str, cap_bytes: int, *, timeout_s: float = 5.0) -> None:
        import redis

        self._redis = redis
        self.prefix = prefix
        self.cap_bytes = cap_bytes
        self._r = RedisAccess.coerce(where, timeout_s).client()
        self._put = self._r.register_script(_PUT)
        self._remove = self._r.register_script(_REMOVE)
        self._lock = threading.Lock()
        self.counters = {"hits": 0, "misses": 0, "puts": 0, "full": 0, "corrupt": 0, "errors": 0}
        self._warned_full = 0.0

    def _keys(self, key: str) -> list[str]:
        return [f"{self.prefix}:blob:{key}", f"{self.prefix}:meta:{key}", f"{self.prefix}:bytes"]

    def _count(self, name: str) -> None:
        with self._lock:
            self.counters[name] += 1

    def _unavailable(self, what: str, err: Exception) -> IndexUnavailableError:
        self._count("errors")
        return IndexUnavailableError(f"the shared KV tier in Redis is unavailable ({what}): {err}")

    # --- ChunkStore
    def contains(self, key: str) -> bool:
        try:
            return bool(self._r.exists(self._keys(key)[1]))
        except self._redis.RedisError:
            return False  # a probe: an unreachable shared tier holds nothing

    def size(self, key: str) -> int | None:
        try:
            raw = self._r.get(self._keys(key)[1])
        except self._redis.RedisError:
            return None
        return None if raw is None else json.loads(raw).get("bytes")

    def get(self, key: str) -> Entry | None:
        blob_key, meta_key, _ = self._keys(key)
        try:
            pipe = self._r.pipeline(transaction=True)
            pipe.get(meta_key)
            pipe.get(blob_key)
            raw_meta, blob = pipe.execute()
        except self._redis.RedisError as err:
            log.warning("%s: reading %s as a miss", self._unavailable("get", err), key[:16])
            self._count("misses")
            return None
        if raw_meta is None or blob is None:
            self._count("misses")
            return None
        meta = json.loads(raw_meta)
        if len(blob) != meta.get("bytes"):
            self._count("corrupt")
            raise CorruptBlobError(f"shared blob {key} has {len(blob)} bytes, its metadata says {meta.get('bytes')}")
        try:
            entry = decode(blob, verify=True, copy=True)
        except CorruptBlobError:
            self._count("corrupt")
            raise
        if entry[2].key != key:
            self._count("corrupt")
            raise CorruptBlobError(f"shared blob stored under {key} belongs under {entry[2].key}")
        self._count("hits")
        return entry

    def put(self, key: str, entry: Entry) -> bool:
        k, v, header = entry
        if header.key != key:
            raise ValueError(f"blob belongs under key {header.key}, not {key}")
        blob = pack(k, v, header)
        meta = json.dumps({"bytes": len(blob), "tokens": header.num_tokens, "checksum": header.checksum,
                           "created_at": time.time()})
        try:
            added = int(self._put(keys=self._keys(key), args=[blob, meta, len(blob), self.cap_bytes]))
        except self._redis.ResponseError as err:
            if "OOM" not in str(err):
                raise
            added = -1  # Redis is at maxmemory: the same as our own cap
        except self._redis.RedisError as err:
            log.warning("%s: chunk %s stays host-local", self._unavailable("put", err), key[:16])
            return False
        if added == -1:
            self._count("full")
            if time.monotonic() - self._warned_full > 60:
                self._warned_full = time.monotonic()
                log.warning("the shared KV tier is full (cap %d MiB): new chunks stay in their host's LMDB",
                            self.cap_bytes >> 20)
            return False
        if added == 1:
            self._count("puts")
        return added == 1

    def remove(self, key: str) -> bool:
        try:
            return bool(self._remove(keys=self._keys(key)))
        except self._redis.RedisError as err:
            log.warning("%s: %s not removed", self._unavailable("remove", err), key[:16])
            return False

    def probe_read(self, nbytes: int = PROBE_BYTES) -> tuple[int, float] | None:
        """A round trip of `nbytes` through this tier, the GET timed: a value written under a probe key of
        this host's own and deleted after (None: Redis does not answer)."""
        key = f"{self.prefix}:probe:{uuid.uuid4().hex}"
        try:
            self._r.set(key, os.urandom(nbytes), ex=60)
            t0 = time.perf_counter()
            got = self._r.get(key)
            seconds = time.perf_counter() - t0
            self._r.delete(key)
        except self._redis.RedisError as err:
            log.warning("%s: not measured", self._unavailable("probe", err))
            return None
        return (len(got), seconds) if got else None

    # --- housekeeping
    def used_bytes(self) -> int:
        return int(self._r.get(self._keys("")[2]) or 0)

    def stats(self) -> dict:
        with self._lock:
            return {f"shared_{k}": v for k, v in self.counters.items()}

    def close(self) -> None:
        self._r.close()
