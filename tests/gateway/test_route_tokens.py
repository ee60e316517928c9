"""gateway/route_tokens.py: a prompt's token ids for precise_prefix, made before the policy chooses.

A reload closes the replaced policy's tokenizing threads while requests may still be waiting on
them; those requests go on (routed by affinity at worst), and the closed policy starts no threads.
"""

from __future__ import annotations

import asyncio
import threading

from gateway.backend import GenerationRequest, SamplingParams
from gateway.breaker import CircuitBreaker
from gateway.models import Deployment
from gateway.route_tokens import INLINE_CHARS, THREADS, PromptTokens
from kvgate_echo import EchoBackend, EchoSettings


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
