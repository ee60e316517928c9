"""Per-key limits shared by every gateway replica, counted in Redis.

`RedisLimiter` has `KeyLimiter`'s interface and semantics (sliding 60 s windows of requests,
weighted by prompts x n, and of tokens; requests in flight), but the counts live in Redis, so
N replicas enforce one budget per key. Each check-and-count is one Lua script (atomic; the time
is Redis's own, so replicas' clocks do not matter). Every Redis key has a TTL: a key nobody uses
for a minute leaves nothing behind.

Per key name, with `{name}` a Redis Cluster hash tag so one script's keys share a slot:

    prefix:{name}:req      ZSET  member "weight:id", score = time   (requests window)
    prefix:{name}:req:sum  the weights in :req                       (so a check is O(expired))
    prefix:{name}:tok      ZSET  member "tokens:id", score = time   (tokens window)
    prefix:{name}:tok:sum
    prefix:{name}:flight   ZSET  member = lease id, score = lease deadline

A request in flight holds a lease that its replica renews every LEASE_S / 3 seconds; a replica
that dies stops renewing, and its leases lapse after LEASE_S instead of holding slots forever.

When Redis cannot be reached the gateway never refuses traffic for it: it counts in a local
`KeyLimiter` (this replica alone, from an empty window), logs it once, sets
`kvgate_limits_store_up` to 0 and shows it on the status page; a probe switches back to Redis
when it answers again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections import defaultdict, deque

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.config import LimitsStoreConfig
from gateway.errors import RateLimited
from gateway.keys.limits import KeyLimiter, check_weight
from gateway.keys.store import ApiKey
from gateway.redis_health import PROBE_S, RedisHealth

log = logging.getLogger("kvgate.limits")

LEASE_S = 30  # an in-flight slot outlives a dead replica by at most this long

# Shared by the scripts: trim a window (KEYS[i], KEYS[i+1] = its sum) and return its total.
_TRIM = """
local function window_total(key, sum_key, now)
  if redis.call('ZCARD', key) == 0 then
    redis.call('DEL', sum_key)  -- the sum cannot outlive its events
    return 0
  end
  local expired = redis.call('ZRANGEBYSCORE', key, '-inf', now - 60)
  local gone = 0
  for _, m in ipairs(expired) do gone = gone + tonumber(string.match(m, '^(%d+):')) end
  if gone > 0 then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now - 60)
    return redis.call('DECRBY', sum_key, gone)
  end
  return tonumber(redis.call('GET', sum_key) or '0')
end

local function window_add(key, sum_key, now, weight, id)
  redis.call('ZADD', key, now, weight .. ':' .. id)
  redis.call('INCRBY', sum_key, weight)
  redis.call('EXPIRE', key, 61)
  redis.call('EXPIRE', sum_key, 61)
end

-- Seconds until the total drops under `limit` as old events expire (KeyLimiter's rule). Read
-- oldest first, a page at a time: a refusal usually ends within the first page, not the window.
local function wait_below(key, total, limit, now)
  local start = 0
  while true do
    local events = redis.call('ZRANGE', key, start, start + 63, 'WITHSCORES')
    if #events == 0 then return 60 end
    for i = 1, #events, 2 do
      total = total - tonumber(string.match(events[i], '^(%d+):'))
      if total < limit then return math.max(0, 60 - (now - tonumber(events[i + 1]))) end
    end
    start = start + 64
  end
end

local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
"""

# KEYS: req, req:sum, tok, tok:sum, flight. ARGV: weight, rpm, tpm, max_concurrency (0: none),
# request id, lease s, tokens to reserve, check only (1/0). Returns {0} admitted, {1, wait_ms} requests/min,
# {2, wait_ms} tokens/min, {3, in_flight} concurrency. The reservation is the tokens window's
# member "<tokens>:r<id>", removed by FINISH.
ADMIT = _TRIM + """
local weight, rpm, tpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local requests = window_total(KEYS[1], KEYS[2], now)
if rpm > 0 and requests + weight > rpm then
  return {1, math.ceil(1000 * wait_below(KEYS[1], requests, rpm - weight + 1, now))}
end
local tokens = window_total(KEYS[3], KEYS[4], now)
if tpm > 0 and tokens >= tpm then
  return {2, math.ceil(1000 * wait_below(KEYS[3], tokens, tpm, now))}
end
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)  -- lapsed leases of dead replicas
  local in_flight = redis.call('ZCARD', KEYS[5])
  if in_flight >= conc then return {3, in_flight} end
end
if ARGV[8] == '1' then return {0} end  -- a check only (before the body is parsed): count nothing
if conc > 0 then
  redis.call('ZADD', KEYS[5], now + tonumber(ARGV[6]), ARGV[5])
  redis.call('EXPIRE', KEYS[5], math.ceil(tonumber(ARGV[6])) + 1)
end
window_add(KEYS[1], KEYS[2], now, weight, ARGV[5])
local reserve = math.min(tonumber(ARGV[7]), tpm)  -- at most the whole minute
if reserve > 0 then window_add(KEYS[3], KEYS[4], now, reserve, 'r' .. ARGV[5]) end
return {0}
"""

# KEYS: tok, tok:sum, flight. ARGV: tokens, request id, lease held (1/0), tokens reserved.
FINISH = _TRIM + """
if ARGV[3] == '1' then redis.call('ZREM', KEYS[3], ARGV[2]) end
local reserved = tonumber(ARGV[4])
if reserved > 0 and redis.call('ZREM', KEYS[1], reserved .. ':r' .. ARGV[2]) == 1 then
  redis.call('DECRBY', KEYS[2], reserved)  -- refunded (unless it already left the window)
end
if tonumber(ARGV[1]) > 0 then
  window_total(KEYS[1], KEYS[2], now)
  window_add(KEYS[1], KEYS[2], now, tonumber(ARGV[1]), ARGV[2])
end
return 0
"""

# KEYS: req, req:sum, tok, tok:sum, flight. ARGV: request id, weight, tokens reserved. Takes back
# an ADMIT whose answer never came (a timeout after it ran): the request is counted locally instead.
UNDO = _TRIM + """
redis.call('ZREM', KEYS[5], ARGV[1])
if redis.call('ZREM', KEYS[1], ARGV[2] .. ':' .. ARGV[1]) == 1 then redis.call('DECRBY', KEYS[2], ARGV[2]) end
if tonumber(ARGV[3]) > 0 and redis.call('ZREM', KEYS[3], ARGV[3] .. ':r' .. ARGV[1]) == 1 then
  redis.call('DECRBY', KEYS[4], ARGV[3])
end
return 0
"""

# KEYS: req, req:sum. ARGV: request id. A request refused before admission, counted.
COUNT = _TRIM + """
window_total(KEYS[1], KEYS[2], now)
window_add(KEYS[1], KEYS[2], now, 1, ARGV[1])
return 0
"""

# KEYS: flight. ARGV: lease s, ids... Renews the leases of requests still in flight here, and
# recreates those a Redis restart (or an outage longer than a lease) lost: they still hold a slot.
RENEW = """
local t = redis.call('TIME')
local deadline = tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], deadline, ARGV[i]) end
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[1])) + 1)
return 0
"""


def make_limiter(cfg: LimitsStoreConfig, env=None):
    """The limiter a gateway serves with. Raises ValueError when the Redis URL is not set."""
    if cfg.kind == "memory":
        return KeyLimiter()
    env = os.environ if env is None else env
    url = env.get(cfg.url_env)
    if not url:
        raise ValueError(f"auth.limits_store.url_env: environment variable {cfg.url_env} is not set")
    password = None
    if cfg.password_env:
        password = env.get(cfg.password_env)
        if not password:
            raise ValueError(f"auth.limits_store.password_env: environment variable {cfg.password_env} is not set")
    return RedisLimiter(cfg, url, password=password)


class RedisLimiter:
    """KeyLimiter's interface, counted in Redis; a local KeyLimiter while Redis is down."""

    def __init__(self, cfg: LimitsStoreConfig, url: str, lease_s: float = LEASE_S, password: str | None = None):
        self.cfg = cfg
        self.lease_s = lease_s
        # A password in the URL wins over `password` (redis-py's rule).
        self.redis = Redis.from_url(url, password=password, socket_timeout=cfg.timeout_s,
                                    socket_connect_timeout=cfg.timeout_s,
                                    retry=Retry(NoBackoff(), 0))  # fail fast: local limits are the retry
        self._admit = self.redis.register_script(ADMIT)  # EVALSHA, re-sent after a Redis restart
        self._finish = self.redis.register_script(FINISH)
        self._renew = self.redis.register_script(RENEW)
        self._count = self.redis.register_script(COUNT)
        self._undo = self.redis.register_script(UNDO)
        self.local = KeyLimiter()
        self.health = RedisHealth(self.redis, log, "limits store", "each replica enforces the limits alone",
                                  "limits are shared by every replica again")
        # Per key name, what each admitted request holds, oldest first: ("redis", id, leased,
        # tokens reserved) or ("local",). Requests of one key are interchangeable for counting, so finish pops any.
        self._held: dict[str, deque] = defaultdict(deque)
        self._tasks: set[asyncio.Task] = set()
        self._background: list[asyncio.Task] = []

    # ------------------------------------------------------------------ admission

    async def acquire(self, key: ApiKey, weight: int = 1, reserve_tokens: int = 0) -> None:
        check_weight(key, weight)
        limited = key.requests_per_minute or key.tokens_per_minute or key.max_concurrency
        reserve = min(reserve_tokens, key.tokens_per_minute or 0)  # as the script caps it
        if self.health.up and limited:  # a key without limits costs no round trip
            request_id = uuid.uuid4().hex
            try:
                answer = await self._admit(keys=self._keys(key.name, "req", "req:sum", "tok", "tok:sum", "flight"),
                                           args=[weight, key.requests_per_minute or 0, key.tokens_per_minute or 0,
                                                 key.max_concurrency or 0, request_id, self.lease_s, reserve, 0])
            except (RedisError, OSError) as exc:
                self.health.went_down(exc)
                # The script may have run and only its answer been lost: take it back once Redis
                # answers, or the request would count twice (here and there) and hold a lease.
                self._spawn(self._undo_in_redis(key, request_id, weight, reserve))
            else:
                _raise_refusal(key, answer)
                self._held[key.name].append(("redis", request_id, bool(key.max_concurrency), reserve))
                return
        self.local.admit(key, weight, reserve)
        self._held[key.name].append(("local",))

    async def admissible(self, key: ApiKey) -> None:
        """Raise 429 when `key` is at one of its limits now, counting nothing (asked before the
        body is read and parsed)."""
        if self.health.up and (key.requests_per_minute or key.tokens_per_minute or key.max_concurrency):
            try:
                answer = await self._admit(keys=self._keys(key.name, "req", "req:sum", "tok", "tok:sum", "flight"),
                                           args=[1, key.requests_per_minute or 0, key.tokens_per_minute or 0,
                                                 key.max_concurrency or 0, "", self.lease_s, 0, 1])
            except (RedisError, OSError) as exc:
                self.health.went_down(exc)
            else:
                return _raise_refusal(key, answer)
        self.local.check(key)

    def count_refused(self, key: ApiKey) -> None:
        if not key.requests_per_minute:
            return
        if not self.health.up:
            return self.local.count_refused(key)
        self._spawn(self._count_in_redis(key))

    async def _count_in_redis(self, key: ApiKey) -> None:
        try:
            await self._count(keys=self._keys(key.name, "req", "req:sum"), args=[uuid.uuid4().hex])
        except (RedisError, OSError) as exc:
            self.health.went_down(exc)
            self.local.count_refused(key)

    def finish(self, key: ApiKey, tokens: int) -> None:
        held = self._held[key.name].popleft() if self._held[key.name] else ("local",)
        if not self._held[key.name]:
            del self._held[key.name]
        if held[0] == "local":
            self.local.finish(key, tokens)
        else:
            self._spawn(self._finish_in_redis(key, tokens, *held[1:]))

    async def _finish_in_redis(self, key: ApiKey, tokens: int, request_id: str, leased: bool, reserved: int) -> None:
        try:
            await self._finish(keys=self._keys(key.name, "tok", "tok:sum", "flight"),
                               args=[tokens, request_id, int(leased), reserved])
        except (RedisError, OSError) as exc:
            self.health.went_down(exc)
            self.local.charge(key, tokens)  # its lease lapses in Redis by itself

    async def _undo_in_redis(self, key: ApiKey, request_id: str, weight: int, reserve: int) -> None:
        deadline = time.monotonic() + self.lease_s  # after that its lease has lapsed by itself
        while time.monotonic() < deadline:
            try:
                await self._undo(keys=self._keys(key.name, "req", "req:sum", "tok", "tok:sum", "flight"),
                                 args=[request_id, weight, reserve])
                return
            except (RedisError, OSError):
                await asyncio.sleep(PROBE_S)

    def _keys(self, name: str, *parts: str) -> list[str]:
        """The Redis keys of one API key's `parts` (the layout in the module docstring)."""
        return [f"{self.cfg.key_prefix}:{{{name}}}:{part}" for part in parts]

    # ------------------------------------------------------------------ health

    async def _renew_leases(self) -> None:
        """Keep this replica's in-flight leases alive (a dead replica's lapse after lease_s)."""
        while True:
            await asyncio.sleep(self.lease_s / 3)
            by_key: dict[str, list[str]] = {}
            for name, held in list(self._held.items()):
                ids = [h[1] for h in held if h[0] == "redis" and h[2]]
                if ids:
                    by_key[name] = ids
            for name, ids in by_key.items():
                if not self.health.up:
                    break
                try:
                    await self._renew(keys=self._keys(name, "flight"), args=[self.lease_s, *ids])
                except (RedisError, OSError) as exc:
                    self.health.went_down(exc)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # a reference, so the task is not collected mid-flight
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        self._background.append(asyncio.get_running_loop().create_task(self._renew_leases()))
        try:
            await self.redis.ping()
            log.info("limits store: Redis reachable; per-key limits are shared by every replica")
        except (RedisError, OSError) as exc:
            self.health.went_down(exc)  # start anyway: serving never waits on the limits store

    async def stop(self) -> None:
        if self._tasks:  # let last finishes reach Redis
            await asyncio.wait(set(self._tasks), timeout=self.cfg.timeout_s)
        for task in [*self._background, *self._tasks]:
            task.cancel()
        self.health.stop()
        await self.redis.aclose()

    def status(self) -> dict:
        return self.health.status()


def _raise_refusal(key: ApiKey, answer) -> None:
    code = int(answer[0])
    if code == 1:
        raise RateLimited(f"Rate limit of {key.requests_per_minute} requests per minute reached for key "
                          f"'{key.name}'.", retry_after_s=int(answer[1]) / 1000)
    if code == 2:
        raise RateLimited(f"Rate limit of {key.tokens_per_minute} tokens per minute reached for key "
                          f"'{key.name}'.", retry_after_s=int(answer[1]) / 1000)
    if code == 3:
        raise RateLimited(f"Key '{key.name}' already has {int(answer[1])} requests in flight (its limit).",
                          retry_after_s=1)
