"""A few hundred concurrent streams against a pool with a fast and a slow deployment.

Checks what must hold under load: least_loaded sends most traffic to the fast deployment, the
interactive class is never refused while the sheddable batch class is, and every stream that
was accepted arrives whole and in order. (Latency figures belong to bench/, not here.)
"""

import asyncio
import json

import httpx
import pytest

from kvgate_echo import reply_pieces
from tests.support.servers.loopback import GatewayServer

CONFIG = """
sla_classes:
  - {name: interactive, priority: 0, max_queue_wait_s: 60}
  - {name: batch, priority: 10, max_queue_wait_s: 60, sheddable: true}
default_sla_class: interactive
models:
  - name: pool
    policy: least_loaded
    queue: {max_size: 500, max_in_flight_per_deployment: 24}
    deployments:
      - {name: fast, backend: echo, settings: {tokens_per_second: 400}}
      - {name: slow, backend: echo, settings: {tokens_per_second: 5}}
"""

INTERACTIVE, BATCH, MAX_TOKENS = 200, 100, 8


def expected(i: int) -> str:
    words = f"req{i} alpha beta gamma".split()
    return "".join(p for _, p in reply_pieces(words, 0, MAX_TOKENS, ())[0])


async def one_stream(client: httpx.AsyncClient, i: int, sla: str) -> tuple[str, int, str | None]:
    body = {"model": "pool", "prompt": f"req{i} alpha beta gamma", "max_tokens": MAX_TOKENS, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body, headers={"x-sla-class": sla}) as r:
        if r.status_code != 200:
            await r.aread()
            return sla, r.status_code, None
        text, done = [], False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text.append(chunk["choices"][0]["text"])
        assert done, "stream ended without [DONE]"
        return sla, 200, "".join(text)


async def storm(base_url: str):
    limits = httpx.Limits(max_connections=INTERACTIVE + BATCH)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=120) as client:
        jobs = [one_stream(client, i, "interactive") for i in range(INTERACTIVE)]
        jobs += [one_stream(client, INTERACTIVE + i, "batch") for i in range(BATCH)]
        return await asyncio.gather(*jobs)


@pytest.fixture(scope="module")
def outcome():
    with GatewayServer(CONFIG) as gw:
        served = {"fast": 0, "slow": 0}
        for name in served:
            backend = gw.backend(name)
            original = backend.generate

            def spy(request, name=name, original=original):
                served[name] += 1
                return original(request)

            backend.generate = spy
        results = asyncio.run(storm(gw.base_url))
        yield results, served


def test_no_stream_is_lost_or_garbled(outcome):
    results, _ = outcome
    for index, (sla, status, text) in enumerate(results):
        assert status in (200, 503)
        if status == 200:
            assert text == expected(index)


def test_interactive_is_never_refused_while_batch_is_shed(outcome):
    results, _ = outcome
    interactive = [status for sla, status, _ in results if sla == "interactive"]
    batch = [status for sla, status, _ in results if sla == "batch"]
    assert interactive == [200] * INTERACTIVE
    assert batch.count(503) > 0


def test_the_fast_deployment_takes_most_of_the_traffic(outcome):
    _, served = outcome
    assert served["fast"] > 3 * served["slow"], served
