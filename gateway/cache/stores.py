"""Where cached answers live: this process's memory (LRU by bytes), or Redis (shared by replicas).

Both keep encoded entries (bytes) for `ttl_s`; an entry larger than `max_bytes` is not kept. The
memory store evicts least recently used entries until the total fits `max_bytes`; the Redis store
keeps each entry under `<prefix>:cache:<model>:<key hash>` with a TTL and leaves eviction under
memory pressure to Redis's own `maxmemory-policy` (allkeys-lru). A Redis that cannot be reached is
a miss (and a store is skipped): the cache never fails a request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

log = logging.getLogger("kvgate.cache")


class MemoryCache:
    kind = "memory"

    def __init__(self, max_bytes: int, ttl_s: float, clock=time.monotonic):
        self.max_bytes, self.ttl_s, self.clock = max_bytes, ttl_s, clock
        self._entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # key -> (expiry, data), LRU first
        self.bytes = 0

    async def get(self, key: str) -> bytes | None:
        found = self._entries.get(key)
        if found is None:
            return None
        if found[0] <= self.clock():
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return found[1]

    def put(self, key: str, data: bytes) -> None:
        if len(data) > self.max_bytes:
            return
        if key in self._entries:
            self._drop(key)
        self._entries[key] = (self.clock() + self.ttl_s, data)
        self.bytes += len(data)
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: str) -> None:
        self.bytes -= len(self._entries.pop(key)[1])

    def __len__(self) -> int:
        return len(self._entries)

    async def stop(self) -> None:
        pass


class RedisCache:
    kind = "redis"

    def __init__(self, url: str, prefix: str, max_bytes: int, ttl_s: float, timeout_s: float = 0.5,
                 password: str | None = None):
        self.prefix, self.max_bytes, self.ttl_s = prefix, max_bytes, ttl_s
        self.redis = Redis.from_url(url, password=password, socket_timeout=timeout_s,
                                    socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
        self._tasks: set[asyncio.Task] = set()
        self.problem: str | None = None

    async def get(self, key: str) -> bytes | None:
        try:
            data = await self.redis.get(f"{self.prefix}:{key}")
        except (RedisError, OSError) as exc:
            self._failed(exc)
            return None
        self.problem = None
        return data

    def put(self, key: str, data: bytes) -> None:
        if len(data) > self.max_bytes:
            return
        task = asyncio.get_running_loop().create_task(self._put(key, data))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _put(self, key: str, data: bytes) -> None:
        try:
            await self.redis.set(f"{self.prefix}:{key}", data, px=int(self.ttl_s * 1000))
        except (RedisError, OSError) as exc:
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        if self.problem is None:
            self.problem = f"Redis unreachable ({type(exc).__name__}: {exc}): every request is a miss"
            log.warning("response cache: %s", self.problem)

    async def stop(self) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=1)
        await self.redis.aclose()
