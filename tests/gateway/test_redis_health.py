"""The shared Redis's outage and return (gateway/redis_health.py), as each store that counts on it
lives through them, against a real redis-server killed and started again on its port."""

import asyncio
import logging
import time

import pytest

from gateway.budgets.redis_store import RedisStore
from gateway.config import LimitsStoreConfig
from gateway.keys.redis_limiter import RedisLimiter
from tests.support.servers.redis_server import redis_or_skip

STORES = {
    "limits store": lambda cfg, url: RedisLimiter(cfg, url),
    "budget store": lambda cfg, url: RedisStore(cfg, url, fail_open=True),
}


async def until_shared(store, timeout_s: float = 30.0) -> None:
    """Wait for the store's probe to find Redis again (the deadline only bounds a broken probe)."""
    deadline = time.monotonic() + timeout_s
    while not store.status()["shared"]:
        assert time.monotonic() < deadline, f"still not shared: {store.status()}"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("name", list(STORES))
def test_a_store_counts_alone_while_redis_is_down_and_shares_again_when_it_answers(name, caplog):
    server = redis_or_skip()
    cfg = LimitsStoreConfig(kind="redis", url_env="X", key_prefix=f"t{time.monotonic_ns()}", timeout_s=0.5)

    async def main():
        store = STORES[name](cfg, server.url)
        server.kill()
        await store.start()  # serving never waits on the store: it starts alone
        status = store.status()
        assert status["shared"] is False and status["problem"].startswith("Redis unreachable"), status
        server.start()  # the same port, as a restarted Redis pod
        await until_shared(store)
        assert store.status()["problem"] is None
        await store.stop()

    caplog.set_level(logging.WARNING)
    try:
        asyncio.run(main())
    finally:
        server.kill()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(name)]
    assert [line.split(";")[0].split(": ", 1)[1].split(" (")[0] for line in lines] == [
        "Redis unreachable", "Redis answers again"], lines  # each once
