"""The shared chunk KV tier in Redis: what one host computed, every host can read.

The lowest storage tier of a fleet worker's `TieredStore` (chunk_store.py): hot RAM -> the host's LMDB
-> this tier -> rebuild from the chunk's token ids. Keys are the content keys of kvfuse.kvblob (they
already include the model fingerprint and the KV dtype), so hosts running the same model share entries
and a host with another model can never read them.

Layout, under `<prefix>:`
  blob:<key>    the chunk's blob, exactly as LMDB keeps it (kvfuse.kvblob, checksummed)
  meta:<key>    JSON {bytes, tokens, checksum, created_at}; written last
  bytes         the running total of blob bytes (what the cap is checked against)
  s3:small, s3:main      S3-FIFO's small and main FIFOs (lists of keys: pushed at the head, taken at the tail)
  s3:ghost, s3:seq       its ghost FIFO (a sorted set of keys by a sequence number) and that sequence
  s3:freq, s3:small_bytes  each held chunk's 2-bit read count; the small FIFO's bytes
  evictions     chunks this tier evicted, every host together

A reader trusts a blob only through its metadata key: no `meta` means no entry, whatever `blob` holds,
and a blob whose length or checksum disagrees with `meta` is damaged (CorruptBlobError; the caller
rebuilds it). A put writes blob, meta and the total in one server-side script, so a half-written blob is
never visible and two hosts storing the same chunk add it once.

Bounded by `cap_bytes` with S3-FIFO (store/eviction_policy.py has the definition, and the same decisions:
tests/store/test_shared_tier_eviction.py replays one sequence through both): a put that would take the
total past the cap evicts in the same script, so eviction is atomic with the put and every host sees one
order. A read adds to the chunk's count in the script that reads it. Redis itself stays `noeviction` (it
holds the document index and the job streams too): a put Redis refuses (maxmemory) is not added, and the
chunk stays in the LMDB of the host that computed it. Entries also go when the last document using them
is deleted (the API's catalog, remote_blobs.py). See docs/DESIGN.md, "Bounded tiers" and "Scale-out".
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid

from kvfuse.kvblob import ChunkEntry, CorruptBlobError, decode, pack
from kvfuse.store.chunk_store import ChunkStore
from kvfuse.store.errors import IndexUnavailableError
from kvfuse.store.eviction_policy import SMALL_SHARE
from kvfuse.store.redis_access import RedisAccess

log = logging.getLogger(__name__)
PROBE_BYTES = 256 << 10  # what a worker reads through this tier at start to measure it

# KEYS: blob meta bytes small main ghost freq small_bytes seq evictions; ARGV: blob meta size cap prefix key
# small_share. Returns {1 added | 0 already there | -1 does not fit, chunks evicted}.
_PUT = """
local function size_of(k)
  local m = redis.call('GET', ARGV[5] .. ':meta:' .. k)
  if not m then return nil end
  return tonumber(cjson.decode(m)['bytes'])
end
local function drop(k, s)
  redis.call('DEL', ARGV[5] .. ':blob:' .. k, ARGV[5] .. ':meta:' .. k)
  redis.call('DECRBY', KEYS[3], s)
  redis.call('HDEL', KEYS[7], k)
  redis.call('INCR', KEYS[10])
end
local function evict_one(cap)
  while true do
    local nsmall, nmain = redis.call('LLEN', KEYS[4]), redis.call('LLEN', KEYS[5])
    if nsmall == 0 and nmain == 0 then return false end
    local sb = tonumber(redis.call('GET', KEYS[8]) or '0')
    if nsmall > 0 and (sb >= cap * tonumber(ARGV[7]) or nmain == 0) then
      local k = redis.call('RPOP', KEYS[4])
      local s = size_of(k)
      if s then
        redis.call('DECRBY', KEYS[8], s)
        if tonumber(redis.call('HGET', KEYS[7], k) or '0') >= 1 then
          redis.call('HSET', KEYS[7], k, 0)
          redis.call('LPUSH', KEYS[5], k)
        else
          redis.call('ZADD', KEYS[6], redis.call('INCR', KEYS[9]), k)
          drop(k, s)
          local over = redis.call('ZCARD', KEYS[6]) - redis.call('LLEN', KEYS[4]) - redis.call('LLEN', KEYS[5])
          if over > 0 then redis.call('ZPOPMIN', KEYS[6], over) end
          return true
        end
      end
    else
      local k = redis.call('RPOP', KEYS[5])
      local s = size_of(k)
      if s then
        local f = tonumber(redis.call('HGET', KEYS[7], k) or '0')
        if f > 0 then
          redis.call('HSET', KEYS[7], k, math.min(f, 3) - 1)
          redis.call('LPUSH', KEYS[5], k)
        else
          drop(k, s)
          return true
        end
      end
    end
  end
end
if redis.call('EXISTS', KEYS[2]) == 1 then return {0, 0} end
local size, cap = tonumber(ARGV[3]), tonumber(ARGV[4])
if size > cap then return {-1, 0} end
local evicted = 0
while tonumber(redis.call('GET', KEYS[3]) or '0') + size > cap do
  if not evict_one(cap) then return {-1, evicted} end
  evicted = evicted + 1
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[2])
redis.call('INCRBY', KEYS[3], size)
redis.call('HSET', KEYS[7], ARGV[6], 0)
if redis.call('ZREM', KEYS[6], ARGV[6]) == 1 then
  redis.call('LPUSH', KEYS[5], ARGV[6])
else
  redis.call('LPUSH', KEYS[4], ARGV[6])
  redis.call('INCRBY', KEYS[8], size)
end
return {1, evicted}
"""

# KEYS: blob meta freq; ARGV: key. A read, and one more on the chunk's 2-bit count.
_GET = """
local meta = redis.call('GET', KEYS[2])
if not meta then return {} end
local f = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '3')
if f < 3 then redis.call('HINCRBY', KEYS[3], ARGV[1], 1) end
return {meta, redis.call('GET', KEYS[1])}
"""

# KEYS: blob meta bytes small main ghost freq small_bytes; ARGV: key
_REMOVE = """
local meta = redis.call('GET', KEYS[2])
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('HDEL', KEYS[7], ARGV[1])
if not meta then return 0 end
local size = cjson.decode(meta)['bytes']
redis.call('DECRBY', KEYS[3], size)
if redis.call('LREM', KEYS[4], 0, ARGV[1]) > 0 then redis.call('DECRBY', KEYS[8], size) end
redis.call('LREM', KEYS[5], 0, ARGV[1])
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
        self._get = self._r.register_script(_GET)
        self._remove = self._r.register_script(_REMOVE)
        self._lock = threading.Lock()
        self.counters = {"hits": 0, "misses": 0, "puts": 0, "full": 0, "corrupt": 0, "errors": 0, "evictions": 0}
        self._warned_full = 0.0

    def _keys(self, key: str) -> list[str]:
        """blob, meta, bytes, then the policy's keys (see the module docstring), in the scripts' order."""
        p = self.prefix
        return [f"{p}:blob:{key}", f"{p}:meta:{key}", f"{p}:bytes", f"{p}:s3:small", f"{p}:s3:main",
                f"{p}:s3:ghost", f"{p}:s3:freq", f"{p}:s3:small_bytes", f"{p}:s3:seq", f"{p}:evictions"]

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

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

    def get(self, key: str) -> ChunkEntry | None:
        keys = self._keys(key)
        try:
            got = self._get(keys=[keys[0], keys[1], keys[6]], args=[key])
        except self._redis.RedisError as err:
            log.warning("%s: reading %s as a miss", self._unavailable("get", err), key[:16])
            self._count("misses")
            return None
        raw_meta, blob = (got + [None, None])[:2]
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
        if entry.header.key != key:
            self._count("corrupt")
            raise CorruptBlobError(f"shared blob stored under {key} belongs under {entry.header.key}")
        self._count("hits")
        return entry

    def put(self, key: str, entry: ChunkEntry) -> bool:
        k, v, header = entry
        if header.key != key:
            raise ValueError(f"blob belongs under key {header.key}, not {key}")
        blob = pack(k, v, header)
        meta = json.dumps({"bytes": len(blob), "tokens": header.num_tokens, "checksum": header.checksum,
                           "created_at": time.time()})
        try:
            added, evicted = map(int, self._put(keys=self._keys(key), args=[
                blob, meta, len(blob), self.cap_bytes, self.prefix, key, SMALL_SHARE]))
            if evicted:
                self._count("evictions", evicted)
        except self._redis.ResponseError as err:
            # redis-py names the OOM reply by its class (OutOfMemoryError) and drops the word from the text
            if not isinstance(err, self._redis.exceptions.OutOfMemoryError) and "OOM" not in str(err):
                raise
            added = -1  # Redis is at maxmemory (noeviction): not added
        except self._redis.RedisError as err:
            log.warning("%s: chunk %s stays host-local", self._unavailable("put", err), key[:16])
            return False
        if added == -1:
            self._count("full")
            if time.monotonic() - self._warned_full > 60:
                self._warned_full = time.monotonic()
                log.warning("the shared KV tier could not take a chunk (cap %d MiB, or Redis at maxmemory): it "
                            "stays in its host's LMDB", self.cap_bytes >> 20)
            return False
        if added == 1:
            self._count("puts")
        return added == 1

    def remove(self, key: str) -> bool:
        try:
            return bool(self._remove(keys=self._keys(key)[:8], args=[key]))
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

    def evictions(self) -> int:
        """Chunks evicted from this tier by every host's puts."""
        return int(self._r.get(self._keys("")[9]) or 0)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {f"shared_{k}": v for k, v in self.counters.items()}

    def close(self) -> None:
        self._r.close()
