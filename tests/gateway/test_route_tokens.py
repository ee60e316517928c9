"""gateway/routing/prompt_tokens.py: a prompt's token ids for precise_prefix, made before the policy chooses.

A reload closes the replaced policy's tokenizing threads while requests may still be waiting on
them; those requests go on (routed by affinity at worst), and the closed policy starts no threads.
Requests with one prompt share one tokenization; a tokenizer that does not answer in time costs a
request tokenize_timeout_s, then affinity; back-offs of deployments long gone are not kept.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from gateway.backend import GenerationRequest, SamplingParams
from gateway.pools.breaker import CircuitBreaker
from gateway.pools.registry import Deployment
from gateway.routing import prompt_tokens as route_tokens
from gateway.routing.prompt_tokens import INLINE_CHARS, THREADS, PromptTokens
from kvgate_echo import ECHO_CAPABILITIES, EchoBackend, EchoSettings


class GatedTokenizer(EchoBackend):
    """An echo backend with a local tokenizer that holds each call until the gate opens."""

    def __init__(self):
        super().__init__(EchoSettings(), name="d")
        self.gate = threading.Event()
        self.calls = 0

    def prompt_token_ids(self, request):
        self.calls += 1
        self.gate.wait(10)
        return [len(request.prompt)]


def long_prompt(i: int) -> GenerationRequest:
    return GenerationRequest(request_id=f"r{i}", model="m", sampling=SamplingParams(),
                             prompt="x" * (INLINE_CHARS + i + 1))  # past INLINE_CHARS: on a thread


def test_closing_while_prompts_wait_for_a_thread_fails_none_and_starts_no_thread():
    async def scenario():
        backend = GatedTokenizer()
        deployments = [Deployment("d", "m", "m", 1.0, backend, CircuitBreaker(3, 1.0), started=True)]
        tokens = PromptTokens(max_chars=100_000, timeout_s=1.0, kept=16)
        waiting = [asyncio.create_task(tokens.prepare(long_prompt(i), deployments)) for i in range(THREADS + 1)]
        while backend.calls < THREADS:  # every thread busy, one prompt queued behind them
            await asyncio.sleep(0.001)
        tokens.close()  # a reload replaced the policy
        backend.gate.set()
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert results == [None] * (THREADS + 1)  # none of the requests failed (CancelledError before)
        await tokens.prepare(long_prompt(99), deployments)  # a late request on the closed policy
        assert tokens._threads is None  # no thread pool made again, none left behind

    asyncio.run(scenario())


def test_a_request_cancelled_while_its_prompt_waits_is_cancelled():
    async def scenario():
        backend = GatedTokenizer()
        deployments = [Deployment("d", "m", "m", 1.0, backend, CircuitBreaker(3, 1.0), started=True)]
        tokens = PromptTokens(max_chars=100_000, timeout_s=1.0, kept=16)
        waiting = [asyncio.create_task(tokens.prepare(long_prompt(i), deployments)) for i in range(THREADS + 1)]
        while backend.calls < THREADS:
            await asyncio.sleep(0.001)
        waiting[-1].cancel()  # its client went away
        backend.gate.set()
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert results[:THREADS] == [None] * THREADS and isinstance(results[-1], asyncio.CancelledError)
        tokens.close()

    asyncio.run(scenario())


class GatedRemote(EchoBackend):
    """An echo backend without a local tokenizer whose /tokenize waits until the gate opens, or
    fails (`down`)."""

    def __init__(self, name: str = "d", down: bool = False):
        super().__init__(EchoSettings(), name=name)
        self.gate = asyncio.Event()
        self.down = down
        self.calls = 0

    async def tokenize(self, request):
        self.calls += 1
        if self.down:
            raise RuntimeError("tokenizer down")
        await self.gate.wait()
        return await super().tokenize(request)


def deployment(backend, name: str = "d") -> Deployment:
    return Deployment(name, "m", "m", 1.0, backend, CircuitBreaker(3, 1.0), started=True,
                      capabilities=ECHO_CAPABILITIES)


def same_prompt(i: int) -> GenerationRequest:
    return GenerationRequest(request_id=f"r{i}", model="m", sampling=SamplingParams(),
                             prompt="word " * (INLINE_CHARS // 4))  # past INLINE_CHARS: on a thread


@pytest.mark.parametrize("where", ["thread", "remote"])
def test_requests_with_the_same_prompt_share_one_tokenization(where):
    async def scenario():
        backend = GatedTokenizer() if where == "thread" else GatedRemote()
        deployments = [deployment(backend)]
        tokens = PromptTokens(max_chars=100_000, timeout_s=10.0, kept=16)
        waiting = [asyncio.create_task(tokens.prepare(same_prompt(i), deployments)) for i in range(3)]
        while backend.calls < 1:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)  # every request is past its check by now (each needs one loop pass)
        backend.gate.set()
        assert await asyncio.gather(*waiting) == [None] * 3
        assert backend.calls == 1
        ids = [tokens.ids(same_prompt(i), deployments) for i in range(3)]
        assert ids[0] and ids == [ids[0]] * 3
        tokens.close()

    asyncio.run(scenario())


def test_the_first_of_requests_sharing_a_tokenization_cancelled_leaves_the_others_to_go_on():
    async def scenario():
        backend = GatedRemote()
        deployments = [deployment(backend)]
        tokens = PromptTokens(max_chars=100_000, timeout_s=10.0, kept=16)
        waiting = [asyncio.create_task(tokens.prepare(same_prompt(i), deployments)) for i in range(3)]
        while backend.calls < 1:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)
        waiting[0].cancel()  # the one tokenizing: its client went away
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert isinstance(results[0], asyncio.CancelledError) and results[1:] == [None, None]
        assert tokens.ids(same_prompt(1), deployments) is None  # no ids: routed by affinity
        backend.gate.set()
        await tokens.prepare(same_prompt(3), deployments)  # a later request tokenizes it anew
        assert backend.calls == 2 and tokens.ids(same_prompt(1), deployments)

    asyncio.run(scenario())


def test_a_local_tokenizer_that_does_not_answer_in_time_routes_by_affinity(caplog):
    async def scenario():
        backend = GatedTokenizer()  # its gate stays shut: a tokenizer that hangs
        deployments = [deployment(backend)]
        tokens = PromptTokens(max_chars=100_000, timeout_s=0.2, kept=16)
        try:
            # bounded by timeout_s (an unbounded wait fails here, after 5 s)
            await asyncio.wait_for(tokens.prepare(long_prompt(0), deployments), 5)
            assert tokens.ids(long_prompt(0), deployments) is None  # no ids: routed by affinity
            assert tokens.local_timeouts == 1 and tokens.failures == 1
        finally:
            backend.gate.set()
            tokens.close()

    with caplog.at_level(logging.WARNING, "kvgate.routing"):
        asyncio.run(scenario())
    assert any("not tokenized within 0.2 s" in r.getMessage() for r in caplog.records)


def test_back_offs_are_dropped_once_over_so_deployments_that_came_and_went_are_not_kept(monkeypatch):
    class Clock:  # route_tokens' own clock, moved by the test (the event loop keeps the real one)
        now = 1000.0

        @staticmethod
        def monotonic() -> float:
            return Clock.now
    monkeypatch.setattr(route_tokens, "time", Clock)

    async def scenario():
        tokens = PromptTokens(max_chars=100_000, timeout_s=1.0, kept=16)
        generations = [[deployment(GatedRemote(f"{g}-{i}", down=True), f"{g}-{i}") for i in range(20)]
                       for g in ("gone", "now")]
        for generation in generations:
            for i, d in enumerate(generation):
                await tokens.prepare(long_prompt(i), [d])
            Clock.now += route_tokens.FAILURE_BACKOFF_S + 1  # this generation's back-offs are over
        Clock.now -= 2  # the last generation's are not quite
        assert tokens.remote_failures == 40
        await tokens.prepare(long_prompt(99), generations[1][:1])  # still backed off: not asked again
        assert generations[1][0].backend.calls == 1
        assert sorted(tokens._backoff) == sorted(d.name for d in generations[1])

    asyncio.run(scenario())
