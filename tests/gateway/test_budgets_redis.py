"""Budgets counted in a real redis-server: two ledgers in one process stand for two replicas."""

import asyncio
import random
import time

import pytest

from gateway.budgets.ledger import Budgets
from gateway.budgets.memory import MemoryStore
from gateway.budgets.redis_store import RedisStore
from gateway.config import BudgetsConfig, LimitsStoreConfig, RequestLimits
from gateway.errors import BudgetExceeded, Overloaded
from gateway.keys.store import ApiKey
from gateway.protocol.completions import parse_completion
from tests.support.servers.redis_server import redis_or_skip

KEY = ApiKey("alice", b"", None, None, None, None, None, team="ml")


@pytest.fixture(scope="module")
def redis():
    server = redis_or_skip()
    yield server
    server.kill()


def ledgers(redis, limits: list[dict], n=2, on_down="open") -> list[Budgets]:
    cfg = BudgetsConfig.model_validate({"limits": limits, "on_store_down": on_down})
    where = LimitsStoreConfig(kind="redis", url_env="X", key_prefix=f"t{time.monotonic_ns()}", timeout_s=2)
    return [Budgets(cfg, {"echo": "echo"}, RedisStore(where, redis.url, fail_open=on_down == "open"))
            for _ in range(n)]


def request(words: int, max_tokens: int, n: int = 1):
    return parse_completion({"model": "echo", "prompt": " ".join(["w"] * words), "max_tokens": max_tokens,
                             "n": n}, RequestLimits())


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def one(ledger: Budgets, words: int, max_tokens: int, used: int) -> int:
    """One request: reserved, a pause (its stream), settled to `used` completion tokens; what it spent."""
    try:
        hold = await ledger.reserve(KEY, "echo", request(words, max_tokens))
    except BudgetExceeded:
        return 0
    await asyncio.sleep(random.random() / 100)
    ledger.settle(hold, usage(words, used), 200)
    return words + used


def test_64_concurrent_requests_on_two_replicas_never_overrun(redis):
    async def main():
        K = 500
        a, b = ledgers(redis, [{"name": "team", "team": "ml", "limit": K, "window": "day"}])
        random.seed(7)
        # each may cost (prompt 9 bytes + 20) = 29 at most, and uses 5 prompt + 1..20 completion tokens
        plans = [(a if i % 2 else b, 5, 20, random.randint(1, 20)) for i in range(64)]
        spent = await asyncio.gather(*(one(*p) for p in plans))
        await a.drain(), await b.drain()
        [view] = await a.info(KEY)
        assert view["spend"] == sum(spent) <= K  # what the requests used, and no more than K
        assert view["reserved"] == 0
        assert sum(1 for s in spent if s) >= K // 29  # while room was left, requests were admitted
        for ledger in (a, b):
            await ledger.stop()
    asyncio.run(main())


def test_a_rolling_window_refuses_until_its_oldest_charge_ages_out(redis):
    async def main():
        [a] = ledgers(redis, [{"name": "r", "key": "alice", "limit": 30, "window": "rolling", "period_s": 100}], n=1)
        await one(a, 5, 10, 10)  # 15 spent (bound 9 + 10 = 19)
        await a.drain()
        with pytest.raises(BudgetExceeded, match="Budget 'r' of key=alice") as info:
            await a.reserve(KEY, "echo", request(5, 10))  # 15 + 19 > 30
        assert 98 <= float(info.value.headers["retry-after-ms"]) / 1000 <= 100
        await a.stop()
    asyncio.run(main())


def test_n_choices_reserve_n_times_the_bound(redis):
    async def main():
        [a] = ledgers(redis, [{"name": "n", "key": "alice", "limit": 100, "window": "day"}], n=1)
        with pytest.raises(BudgetExceeded, match="may need 116"):
            await a.reserve(KEY, "echo", request(4, 22, n=4))  # (7 bytes + 22) x 4
        hold = await a.reserve(KEY, "echo", request(4, 18, n=4))  # (7 + 18) x 4 = 100
        assert (await a.info(KEY))[0]["reserved"] == 100
        a.settle(hold, usage(4, 4 * 18), 200)
        await a.drain()
        assert (await a.info(KEY))[0]["spend"] == 4 + 72
        await a.stop()
    asyncio.run(main())


@pytest.mark.parametrize("on_down", ["open", "closed"])
def test_redis_outage_fails_open_or_closed_as_set(on_down):
    async def main():
        server = redis_or_skip()
        [a] = ledgers(server, [{"name": "d", "key": "alice", "limit": 100, "window": "day"}], n=1, on_down=on_down)
        await a.start()
        hold = await a.reserve(KEY, "echo", request(2, 2))
        server.kill()
        if on_down == "closed":
            with pytest.raises(Overloaded) as refused:
                await a.reserve(KEY, "echo", request(2, 2))
            assert refused.value.status == 503 and refused.value.code == "budget_store_unavailable"
        else:
            local = await a.reserve(KEY, "echo", request(2, 2))  # counted on this replica alone
            a.settle(local, usage(2, 2), 200)
        a.settle(hold, usage(2, 2), 200)  # admitted before the outage: charged locally
        await a.drain()
        assert a.store.status()["shared"] is False and "Redis unreachable" in a.store.status()["problem"]
        await a.stop()
    asyncio.run(main())


def test_the_memory_store_refuses_the_same_way():
    async def main():
        cfg = BudgetsConfig.model_validate({"limits": [{"name": "m", "key": "*", "limit": 40, "window": "month"}]})
        a = Budgets(cfg, {"echo": "echo"}, MemoryStore())
        holds = [await a.reserve(KEY, "echo", request(5, 10)) for _ in range(2)]  # 2 x 19 held
        with pytest.raises(BudgetExceeded, match="key=alice"):
            await a.reserve(KEY, "echo", request(5, 10))
        for h in holds:
            a.settle(h, usage(5, 1), 200)
        await a.drain()
        assert (await a.info(KEY))[0]["spend"] == 12  # refunded to what was used
        await a.reserve(KEY, "echo", request(5, 10))
    asyncio.run(main())


def test_a_gateway_failing_closed_answers_503_and_frees_the_key():
    import httpx

    from tests.support.servers.loopback import GatewayServer

    server = redis_or_skip()
    mp = pytest.MonkeyPatch()
    mp.setenv("KVGATE_TEST_BUDGET_REDIS", server.url)
    config = """
auth:
  keys: [{name: alice, key: sk-alice-0123456789, max_concurrency: 1}]
budgets:
  store: {kind: redis, url_env: KVGATE_TEST_BUDGET_REDIS, timeout_s: 0.5}
  on_store_down: closed
  limits: [{name: d, key: alice, limit: 1000, window: day}]
models: [{name: echo, deployments: [{name: e0, backend: echo}]}]
"""
    body = {"model": "echo", "prompt": "a b", "max_tokens": 2}
    headers = {"authorization": "Bearer sk-alice-0123456789"}
    try:
        with GatewayServer(config) as gw:
            post = lambda: httpx.post(gw.base_url + "/v1/completions", json=body, headers=headers, timeout=10)
            assert post().status_code == 200
            server.kill()
            for _ in range(2):  # the first refusal released the key's one slot: the second is a 503 too, not a 429
                r = post()
                assert r.status_code == 503 and r.json()["error"]["code"] == "budget_store_unavailable"
    finally:
        mp.undo()
        server.kill()
