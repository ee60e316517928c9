"""RedisLimiter against a real redis-server: two limiters in one process stand for two replicas."""

import asyncio
import time

import pytest

from gateway.config import ConfigError, LimitsStoreConfig, parse_config
from gateway.errors import InvalidRequestError, RateLimited
from gateway.keys.redis_limiter import RedisLimiter, make_limiter
from gateway.keys.store import ApiKey
from tests.support.servers.redis_server import redis_or_skip
from tests.support.servers.loopback import free_port


def key(name="k", rpm=None, tpm=None, conc=None) -> ApiKey:
    return ApiKey(name, b"", None, None, rpm, tpm, conc)


@pytest.fixture(scope="module")
def redis():
    server = redis_or_skip()
    yield server
    server.kill()


def replicas(redis, n=2, **kw):
    cfg = LimitsStoreConfig(kind="redis", url_env="X", key_prefix=f"t{time.monotonic_ns()}")
    return [RedisLimiter(cfg, redis.url, **kw) for _ in range(n)]


async def settle(*limiters):
    """Wait for the finishes sent to Redis in the background."""
    for lim in limiters:
        if lim._tasks:
            await asyncio.wait(set(lim._tasks))


async def close(*limiters):
    for lim in limiters:
        await lim.stop()


def test_requests_per_minute_weighted_by_choices_across_replicas(redis):
    async def main():
        a, b = replicas(redis)
        k = key(rpm=10)
        for _ in range(3):
            await a.acquire(k, 3)  # 9: three requests of 3 choices (prompts x n)
        await b.acquire(k, 1)  # 10
        with pytest.raises(RateLimited, match="10 requests per minute") as info:
            await a.acquire(k, 1)
        assert 55 <= float(info.value.headers["retry-after-ms"]) / 1000 <= 60  # the oldest event expires first
        with pytest.raises(InvalidRequestError, match="11 choices"):
            await b.acquire(k, 11)  # can never pass: a 400, not a 429
        await close(a, b)
    asyncio.run(main())


def test_tokens_per_minute_charged_at_finish_are_seen_by_the_other_replica(redis):
    async def main():
        a, b = replicas(redis)
        k = key(tpm=100)
        await a.acquire(k)
        await b.acquire(k)  # under 100 tokens so far: admitted
        a.finish(k, 60)
        b.finish(k, 40)
        await settle(a, b)
        with pytest.raises(RateLimited, match="100 tokens per minute"):
            await b.acquire(k)
        await close(a, b)
    asyncio.run(main())


def test_concurrency_is_shared_and_freed_by_finish(redis):
    async def main():
        a, b = replicas(redis)
        k = key(conc=2)
        await a.acquire(k)
        await b.acquire(k)
        with pytest.raises(RateLimited, match="already has 2 requests in flight"):
            await a.acquire(k)
        b.finish(k, 0)
        await settle(b)
        await a.acquire(k)
        await close(a, b)
    asyncio.run(main())


def test_a_dead_replicas_slots_lapse_with_its_leases(redis):
    async def main():
        dead, alive = replicas(redis, lease_s=1)
        k = key(conc=1)
        await dead.acquire(k)  # never finished, never renewed: its replica is gone
        with pytest.raises(RateLimited):
            await alive.acquire(k)
        deadline = time.monotonic() + 10
        while True:
            try:
                await alive.acquire(k)
                break
            except RateLimited:
                assert time.monotonic() < deadline, "the lease never lapsed"
                await asyncio.sleep(0.2)
        await close(dead, alive)
    asyncio.run(main())


def test_old_events_leave_the_window(redis):
    async def main():
        (a,) = replicas(redis, n=1)
        k = key(rpm=2)
        seconds, micros = await a.redis.time()
        req, total = a._keys(k.name, "req", "req:sum")
        await a.redis.zadd(req, {"2:old": seconds + micros / 1e6 - 59.5})  # two requests 59.5 s ago
        await a.redis.set(total, 2)
        with pytest.raises(RateLimited) as info:
            await a.acquire(k)
        assert float(info.value.headers["retry-after-ms"]) <= 1000
        deadline = time.monotonic() + 10
        while True:
            try:
                await a.acquire(k)
                break
            except RateLimited:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
        assert int(await a.redis.get(total)) == 1  # the expired weight left the sum
        assert 0 < await a.redis.ttl(req) <= 61  # and every key expires by itself
        await close(a)
    asyncio.run(main())


def test_unreachable_redis_at_start_serves_on_local_limits(caplog):
    async def main():
        cfg = LimitsStoreConfig(kind="redis", url_env="X", timeout_s=0.2)
        lim = RedisLimiter(cfg, f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
        await lim.start()
        assert lim.status()["shared"] is False and "Redis unreachable" in lim.status()["problem"]
        k = key(rpm=2)
        await lim.acquire(k)
        await lim.acquire(k)
        with pytest.raises(RateLimited):
            await lim.acquire(k)  # the key's limits still hold, for this replica alone
        await close(lim)
    asyncio.run(main())
    assert "limits store: Redis unreachable" in caplog.text


def test_config_needs_a_url_for_redis():
    with pytest.raises(ConfigError, match=r"auth.limits_store: .*url_env is required"):
        parse_config("auth: {limits_store: {kind: redis}}\n"
                     "models:\n  - name: m\n    deployments: [{name: d, backend: echo}]\n")
    with pytest.raises(ValueError, match="environment variable NOPE_UNSET is not set"):
        make_limiter(LimitsStoreConfig(kind="redis", url_env="NOPE_UNSET"), env={})


def test_a_named_password_variable_must_be_set():
    cfg = LimitsStoreConfig(kind="redis", url_env="URL", password_env="NOPE_UNSET")
    with pytest.raises(ValueError, match="password_env: environment variable NOPE_UNSET is not set"):
        make_limiter(cfg, env={"URL": "redis://127.0.0.1:1/0"})


def test_tokens_reserved_at_admission_are_shared_and_refunded_at_finish(redis):
    async def main():
        a, b = replicas(redis)
        k = key(tpm=100)
        await a.acquire(k, reserve_tokens=4096)  # charged the key's whole minute
        with pytest.raises(RateLimited, match="100 tokens per minute"):
            await b.acquire(k, reserve_tokens=10)  # the other replica sees the reservation
        a.finish(k, 30)
        await settle(a)
        await b.acquire(k, reserve_tokens=60)  # 30 used + 60
        await a.acquire(k, reserve_tokens=20)  # under the minute when admitted: 110
        with pytest.raises(RateLimited, match="100 tokens per minute"):
            await a.acquire(k)
        b.finish(k, 0)
        a.finish(k, 0)
        await settle(a, b)
        await a.acquire(k)
        a.finish(k, 0)
        await settle(a)
        await close(a, b)
    asyncio.run(main())


def test_a_key_at_its_limit_is_found_without_counting_and_refusals_count(redis):
    async def main():
        a, b = replicas(redis)
        k = key(rpm=2)
        await a.admissible(k)
        await a.admissible(k)  # asking counts nothing
        await a.acquire(k)
        b.count_refused(k)  # a 400 on the other replica: still one of the key's two
        await settle(b)
        with pytest.raises(RateLimited, match="2 requests per minute"):
            await a.admissible(k)
        with pytest.raises(RateLimited, match="2 requests per minute"):
            await b.acquire(k)
        await close(a, b)
    asyncio.run(main())


def test_an_admission_whose_answer_was_lost_is_taken_back_in_redis(redis):
    """A timeout after the ADMIT script ran: the request is counted here (local limits), so its
    count and lease in Redis are taken back, not left to count twice."""
    from redis import Redis as SyncRedis
    from redis.exceptions import TimeoutError as RedisTimeout

    async def main():
        [lim] = replicas(redis, 1)
        admit = lim._admit

        async def answer_lost(**kw):
            await admit(**kw)
            raise RedisTimeout("the reply did not come in time")

        lim._admit = answer_lost
        k = key(rpm=5, tpm=1000, conc=2)
        await lim.acquire(k, reserve_tokens=100)
        assert lim.status()["shared"] is False  # counted locally
        await settle(lim)
        keys = [lim._keys(k.name, part)[0] for part in ("req", "req:sum", "tok", "tok:sum", "flight")]
        sync = SyncRedis.from_url(redis.url)
        try:
            assert sync.zcard(keys[0]) == 0 and int(sync.get(keys[1]) or 0) == 0
            assert sync.zcard(keys[2]) == 0 and int(sync.get(keys[3]) or 0) == 0
            assert sync.zcard(keys[4]) == 0  # no phantom lease
        finally:
            sync.close()
        lim.finish(k, 0)
        await close(lim)
    asyncio.run(main())


def test_a_lease_a_redis_restart_lost_is_recreated_while_the_request_runs(redis):
    from redis import Redis as SyncRedis

    async def main():
        [lim] = replicas(redis, 1, lease_s=0.3)  # renewed every 0.1 s
        await lim.start()
        k = key(conc=1)
        await lim.acquire(k)
        flight = lim._keys(k.name, "flight")[0]
        sync = SyncRedis.from_url(redis.url)
        try:
            sync.delete(flight)  # what a restarted Redis holds
            deadline = time.monotonic() + 10
            while sync.zcard(flight) != 1:
                assert time.monotonic() < deadline, "the lease was never recreated"
                await asyncio.sleep(0.02)
            with pytest.raises(RateLimited, match="already has 1 requests in flight"):
                await lim.acquire(k)  # the slot is held again, for every replica
        finally:
            sync.close()
        lim.finish(k, 0)
        await settle(lim)
        await close(lim)
    asyncio.run(main())


def test_a_refusal_over_a_large_window_says_how_long_to_wait(redis):
    async def main():
        [lim] = replicas(redis, 1)
        k = key(rpm=150)
        for _ in range(150):
            await lim.acquire(k)
            lim.finish(k, 0)
        with pytest.raises(RateLimited) as info:
            await lim.acquire(k)
        assert 1 <= int(info.value.headers["Retry-After"]) <= 60
        await settle(lim)
        await close(lim)
    asyncio.run(main())
