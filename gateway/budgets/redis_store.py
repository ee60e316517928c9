"""Spend counted in Redis, shared by every replica: MemoryStore's interface, each call one Lua script.

A request's budgets are checked and held in one script (atomic: two replicas cannot both take the
last room). Per budget and subject, under one hash tag (a script's keys share a Redis Cluster slot):

    prefix:{budgets}:<budget>:<subject>:<window start>  spend of a calendar window (float; TTL to its end)
    prefix:{budgets}:<budget>:<subject>:roll            ZSET of a rolling window's charges ("amount:id", time)
    prefix:{budgets}:<budget>:<subject>:roll:sum        their sum
    prefix:{budgets}:<budget>:<subject>:held            ZSET of reservations ("amount:id", deadline)

Amounts cross the script as strings (a Lua number returned to Redis is cut to an integer). When
Redis cannot be reached, `on_store_down` decides: open admits and counts in a local MemoryStore
(this replica alone, from zero) until a probe finds Redis again; closed refuses with 503.
"""

from __future__ import annotations

import logging

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.budgets.memory import Charge, MemoryStore, Verdict
from gateway.config import LimitsStoreConfig
from gateway.errors import Overloaded
from gateway.redis_health import PROBE_S, RedisHealth

log = logging.getLogger("kvgate.budgets")

_COMMON = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local function amount_of(member) return tonumber(string.match(member, '^([^:]+):')) end

-- The spend of budget i (KEYS[3i-2] its counter or rolling events, KEYS[3i-1] the events' sum).
local function spend(i, period)
  local key, sum_key = KEYS[3 * i - 2], KEYS[3 * i - 1]
  if period == 0 then return tonumber(redis.call('GET', key) or '0') end
  local gone = 0
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', key, '-inf', now - period)) do gone = gone + amount_of(m) end
  if gone > 0 then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now - period)
    return tonumber(redis.call('INCRBYFLOAT', sum_key, -gone))
  end
  return tonumber(redis.call('GET', sum_key) or '0')
end

local function held(i)
  local key = KEYS[3 * i]
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)  -- reservations of requests long gone
  local total = 0
  for _, m in ipairs(redis.call('ZRANGE', key, 0, -1)) do total = total + amount_of(m) end
  return total
end
"""

# KEYS: 3 per budget (counter or events, events' sum, holds). ARGV: id, hold ttl s, then 5 per
# budget: limit, amount, shadow (1/0), rolling period (0: calendar), calendar seconds left.
# Returns {refused index (0: none), wait s, spend 1, held 1, spend 2, held 2, ...} as strings.
RESERVE = _COMMON + """
local n = (#ARGV - 2) / 5
local out, refused, wait = {}, 0, 0
for i = 1, n do
  local b = 2 + 5 * (i - 1)
  local limit, amount, shadow = tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2]), ARGV[b + 3]
  local period = tonumber(ARGV[b + 4])
  local s, h = spend(i, period), held(i)
  out[#out + 1] = tostring(s)
  out[#out + 1] = tostring(h)
  if refused == 0 and shadow == '0' and s + h + amount > limit then
    refused = i
    wait = tonumber(ARGV[b + 5])
    if period > 0 then  -- until enough of the oldest charges age out
      local over = s + h + amount - limit
      wait = period
      local events = redis.call('ZRANGE', KEYS[3 * i - 2], 0, -1, 'WITHSCORES')
      for j = 1, #events, 2 do
        over = over - amount_of(events[j])
        if over <= 0 then wait = math.max(0, tonumber(events[j + 1]) + period - now); break end
      end
    end
  end
end
if refused == 0 then
  for i = 1, n do
    local b = 2 + 5 * (i - 1)
    redis.call('ZADD', KEYS[3 * i], now + tonumber(ARGV[2]), ARGV[b + 2] .. ':' .. ARGV[1])
    redis.call('EXPIRE', KEYS[3 * i], math.ceil(tonumber(ARGV[2])) + 1)
  end
end
table.insert(out, 1, tostring(wait))
table.insert(out, 1, tostring(refused))
return out
"""

# KEYS as RESERVE. ARGV: id, then 4 per budget: amount held, amount used, rolling period, seconds
# the calendar counter lives. Returns each budget's spend after it, as strings.
SETTLE = _COMMON + """
local n = (#ARGV - 1) / 4
local out = {}
for i = 1, n do
  local b = 1 + 4 * (i - 1)
  redis.call('ZREM', KEYS[3 * i], ARGV[b + 1] .. ':' .. ARGV[1])
  local used, period = tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3])
  if period == 0 then
    if used > 0 then
      redis.call('INCRBYFLOAT', KEYS[3 * i - 2], ARGV[b + 2])
      redis.call('EXPIRE', KEYS[3 * i - 2], math.ceil(tonumber(ARGV[b + 4])))
    end
  else
    spend(i, period)
    if used > 0 then
      redis.call('ZADD', KEYS[3 * i - 2], now, ARGV[b + 2] .. ':' .. ARGV[1])
      redis.call('INCRBYFLOAT', KEYS[3 * i - 1], ARGV[b + 2])
      redis.call('EXPIRE', KEYS[3 * i - 2], math.ceil(period) + 1)
      redis.call('EXPIRE', KEYS[3 * i - 1], math.ceil(period) + 1)
    end
  end
  out[#out + 1] = tostring(spend(i, period))
end
return out
"""

# KEYS as RESERVE. ARGV: a rolling period per budget. Returns spend, held per budget.
READ = _COMMON + """
local out = {}
for i = 1, #ARGV do
  out[#out + 1] = tostring(spend(i, tonumber(ARGV[i])))
  out[#out + 1] = tostring(held(i))
end
return out
"""


def _num(x: float) -> str:
    return repr(float(x))


class RedisStore:
    kind = "redis"

    def __init__(self, cfg: LimitsStoreConfig, url: str, password: str | None = None, fail_open: bool = True,
                 reservation_ttl_s: float = 3600.0):
        self.cfg = cfg
        self.fail_open = fail_open
        self.reservation_ttl_s = reservation_ttl_s
        self.redis = Redis.from_url(url, password=password, socket_timeout=cfg.timeout_s,
                                    socket_connect_timeout=cfg.timeout_s, retry=Retry(NoBackoff(), 0))
        self._reserve = self.redis.register_script(RESERVE)
        self._settle = self.redis.register_script(SETTLE)
        self._read = self.redis.register_script(READ)
        self.local = MemoryStore(reservation_ttl_s)
        how = "this replica counts alone" if fail_open else "requests with budgets are refused (fail closed)"
        self.health = RedisHealth(self.redis, log, "budget store", how, "spend is shared by every replica again")
        self._local_ids: set[str] = set()  # requests admitted on local counts: they settle there

    def _keys(self, charges: list[Charge]) -> list[str]:
        out = []
        for c in charges:
            base = f"{self.cfg.key_prefix}:{{budgets}}:{c.budget}:{c.subject}"
            out += [f"{base}:{c.window}", f"{base}:roll:sum", f"{base}:held"]
        return out

    async def reserve(self, request_id: str, charges: list[Charge]) -> Verdict:
        if self.health.up:
            args = [request_id, self.reservation_ttl_s]
            for c in charges:
                args += [_num(c.limit), _num(c.amount), int(c.shadow), c.period_s, c.ttl_s]
            try:
                answer = [float(x) for x in await self._reserve(keys=self._keys(charges), args=args)]
            except (RedisError, OSError) as exc:
                self.health.went_down(exc)
            else:
                refused = int(answer[0])
                return Verdict(refused - 1 if refused else None, answer[2::2], answer[3::2], answer[1])
        if not self.fail_open:
            raise Overloaded("The budget store is unreachable and budgets fail closed; try again later.",
                             retry_after_s=PROBE_S, code="budget_store_unavailable")
        self._local_ids.add(request_id)
        return await self.local.reserve(request_id, charges)

    async def settle(self, request_id: str, charges: list[Charge]) -> list[float]:
        if request_id in self._local_ids:
            self._local_ids.discard(request_id)
            return await self.local.settle(request_id, charges)
        args = [request_id]
        for c in charges:
            args += [_num(c.held), _num(c.amount), c.period_s, c.ttl_s + 60]
        try:
            return [float(x) for x in await self._settle(keys=self._keys(charges), args=args)]
        except (RedisError, OSError) as exc:
            self.health.went_down(exc)  # its hold lapses after reservation_ttl_s; the use is counted here
            return await self.local.settle(request_id, charges)

    async def read(self, charges: list[Charge]) -> list[tuple[float, float]]:
        if self.health.up:
            try:
                answer = [float(x) for x in await self._read(keys=self._keys(charges),
                                                             args=[c.period_s for c in charges])]
                return list(zip(answer[::2], answer[1::2]))
            except (RedisError, OSError) as exc:
                self.health.went_down(exc)
        return await self.local.read(charges)

    async def start(self) -> None:
        try:
            await self.redis.ping()
        except (RedisError, OSError) as exc:
            self.health.went_down(exc)

    async def stop(self) -> None:
        self.health.stop()
        await self.redis.aclose()

    def status(self) -> dict:
        return self.health.status()
