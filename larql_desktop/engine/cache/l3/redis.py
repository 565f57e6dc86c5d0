"""The shared L3 backend: a Redis server (the optional `redis` extra), its LRU kept by Lua scripts that update
the value, its recency and the per-layer counts in one step."""
from __future__ import annotations

import logging
import time

from larql_desktop.engine.cache.l3.contract import RETRY_AFTER, L3Settings, L3Store

log = logging.getLogger("larql_desktop.engine.cache.l3")   # one logger for the store, whichever part logs

_REDIS_GET = """
local v = redis.call('GET', KEYS[1])
if v then
  redis.call('ZADD', KEYS[2], 'XX', redis.call('INCR', KEYS[3]), KEYS[1])
end
return v
"""

_REDIS_PUT = """
local n = string.len(ARGV[1])
local old = redis.call('STRLEN', KEYS[1])
local layer = ARGV[2]
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[3]), KEYS[1])
if old == 0 then redis.call('HINCRBY', KEYS[4], 'e' .. layer, 1) end
redis.call('HINCRBY', KEYS[4], 'b' .. layer, n - old)
local total = redis.call('HINCRBY', KEYS[4], 'total', n - old)
local cap = tonumber(ARGV[3])
local evicted = 0
while total > cap do
  local victim = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not victim then break end
  local vl = string.match(victim, ':v:(%d+):')
  local size = redis.call('STRLEN', victim)
  redis.call('DEL', victim)
  redis.call('ZREM', KEYS[2], victim)
  if vl then
    redis.call('HINCRBY', KEYS[4], 'e' .. vl, -1)
    redis.call('HINCRBY', KEYS[4], 'b' .. vl, -size)
    redis.call('HINCRBY', KEYS[4], 'x' .. vl, 1)
  end
  total = redis.call('HINCRBY', KEYS[4], 'total', -size)
  evicted = evicted + 1
end
return evicted
"""

# Deletes a bad value only if it is still the one read (a writer may have replaced it since), keeping the counts.
_REDIS_DELETE_IF = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local size = string.len(ARGV[1])
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], KEYS[1])
redis.call('HINCRBY', KEYS[3], 'e' .. ARGV[2], -1)
redis.call('HINCRBY', KEYS[3], 'b' .. ARGV[2], -size)
redis.call('HINCRBY', KEYS[3], 'total', -size)
return 1
"""


class RedisL3(L3Store):
    """L3 on a Redis server: every process using the same URL and prefix shares the entries.

    Values are plain strings; a sorted set orders them by last use (a shared counter, so recency is global) and
    a hash keeps per-layer entry and byte counts. The write and its evictions run as one Lua script (atomic).
    """

    backend = "redis"

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", prefix: str = "larql:l3",
                 settings: L3Settings = L3Settings(), timeout: float = 0.25, client=None):
        super().__init__(settings)
        import redis   # the optional `redis` extra

        self._redis = redis
        self.url = url
        self.prefix = prefix
        self.client = client if client is not None else redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, health_check_interval=30)
        self._get_script = self.client.register_script(_REDIS_GET)
        self._put_script = self.client.register_script(_REDIS_PUT)
        self._delete_script = self.client.register_script(_REDIS_DELETE_IF)
        self._lru, self._clock, self._stats = (f"{prefix}:lru", f"{prefix}:clock", f"{prefix}:stats")

    @property
    def where(self) -> str:
        return f"{self.url} {self.prefix}"

    def _key(self, layer: int, ns: int, key: int) -> str:
        return f"{self.prefix}:v:{layer}:{ns & 0xFFFFFFFFFFFFFFFF:016x}:{key & 0xFFFFFFFFFFFFFFFF:016x}"

    def _failed(self, exc: Exception) -> None:
        r = self._redis.exceptions
        if isinstance(exc, (r.ConnectionError, r.TimeoutError)):
            self._report("unreachable", exc, f"skipped, retried every {RETRY_AFTER:.0f} s")
        else:
            self._report("error", exc, f"skipped for {RETRY_AFTER:.0f} s")
        self._skip()

    def _get(self, layer, ns, key):
        try:
            blob = self._get_script(keys=[self._key(layer, ns, key), self._lru, self._clock])
        except self._redis.exceptions.RedisError as exc:
            self._failed(exc)
            return None
        return blob

    def _delete_if(self, layer, ns, key, blob):
        try:
            self._delete_script(keys=[self._key(layer, ns, key), self._lru, self._stats], args=[blob, layer])
        except self._redis.exceptions.RedisError as exc:
            self._failed(exc)

    def _put(self, layer, ns, key, entry, nbytes):
        blob = self._encode(layer, ns, key, entry)
        try:
            self._put_script(keys=[self._key(layer, ns, key), self._lru, self._clock, self._stats],
                             args=[blob, layer, self.settings.max_bytes])
        except self._redis.exceptions.RedisError as exc:
            self._failed(exc)
            return False
        return True

    def occupancy(self, n_layers):
        keys, entries, nbytes, evictions, dropped = super().occupancy(n_layers)
        if not self.settings.enabled or time.monotonic() < self._skip_until:
            return keys, entries, nbytes, evictions, dropped
        try:
            stats = self.client.hgetall(self._stats)
        except self._redis.exceptions.RedisError as exc:
            self._failed(exc)
            return keys, entries, nbytes, evictions, dropped
        for field, value in stats.items():
            field = field.decode() if isinstance(field, bytes) else field
            if field[:1] in ("e", "b", "x") and field[1:].isdigit() and int(field[1:]) < n_layers:
                {"e": entries, "b": nbytes, "x": evictions}[field[0]][int(field[1:])] = int(value)
        keys[:] = entries
        return keys, entries, nbytes, evictions, dropped

    def total_bytes(self) -> int:
        try:
            return int(self.client.hget(self._stats, "total") or 0)
        except self._redis.exceptions.RedisError as exc:
            self._failed(exc)
            return 0

    def clear(self) -> None:
        try:
            doomed = list(self.client.scan_iter(match=f"{self.prefix}:*", count=1000))
            for i in range(0, len(doomed), 1000):
                self.client.delete(*doomed[i:i + 1000])
        except self._redis.exceptions.RedisError as exc:
            self._failed(exc)

    def close(self) -> None:
        try:
            self.client.close()
        except self._redis.exceptions.RedisError:
            pass
