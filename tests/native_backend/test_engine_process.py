"""The engine process and its async client: IPC, streaming, abort, death and start-up failures.

A small deterministic core stands in for the real engine (this tests the process layer only):
token i of a request is (sum(prompt) + i) % 1000, one token per request per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest

from native_backend.core.interface import EngineError, EngineRequest, EngineStats, RequestOutput
from native_backend.core.sampling_params import SamplingParams
from native_backend.process.client import AsyncEngineClient
from native_backend.process.protocol import EngineDeadError, EngineStartupError

CRASH_TOKEN = -1  # a prompt starting with it makes the core's next step kill the process
MAX_PROMPT_TOKENS = 64


@pytest.fixture(autouse=True)
def importable_test_module(monkeypatch):
    """The spawned engine unpickles factories defined here by module name
    (tests.native_backend.test_engine_process): give it the repository root on sys.path."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    return [(sum(prompt) + i) % 1000 for i in range(n)]


class ScriptedCore:
    """Deterministic stand-in for EngineCore (implements EngineCoreProtocol)."""

    def __init__(self, step_delay_s: float = 0.0):
        self.step_delay_s = step_delay_s
        self.running: dict[str, tuple[EngineRequest, list[int]]] = {}
        self.aborted: list[str] = []
        self.crash_on_next_step = False

    def add_request(self, request: EngineRequest) -> None:
        prompt = request.prompt_token_ids
        if not prompt:
            raise EngineError("invalid", "prompt is empty")
        if len(prompt) > MAX_PROMPT_TOKENS:
            raise EngineError("context_length", f"prompt has {len(prompt)} tokens, max {MAX_PROMPT_TOKENS}")
        self.crash_on_next_step |= prompt[0] == CRASH_TOKEN
        self.running[request.request_id] = (request, [])

    def abort(self, request_id: str) -> None:
        if self.running.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_delay_s)
        if self.crash_on_next_step:
            os._exit(3)
        outputs = []
        for request_id, (request, generated) in list(self.running.items()):
            token = expected_tokens(request.prompt_token_ids, len(generated) + 1)[-1]
            generated.append(token)
            done = len(generated) == request.sampling.max_tokens
            if done:
                del self.running[request_id]
            outputs.append(RequestOutput(
                request_id, [token], f"<{token}>", finish_reason="length" if done else None,
                num_prompt_tokens=len(request.prompt_token_ids), num_output_tokens=len(generated)))
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def stats(self) -> "ScriptedStats":
        return ScriptedStats(num_running=len(self.running), aborted=tuple(self.aborted))


@dataclasses.dataclass(frozen=True)
class ScriptedStats(EngineStats):
    aborted: tuple[str, ...] = ()  # what the core was told to abort, so tests can see it


def make_core(step_delay_s: float = 0.0) -> ScriptedCore:
    return ScriptedCore(step_delay_s)


def failing_factory() -> ScriptedCore:
    raise FileNotFoundError("no model at /models/missing.gguf")


def slow_factory() -> ScriptedCore:
    time.sleep(60)
    return ScriptedCore()


def request(request_id: str, prompt: list[int], max_tokens: int) -> EngineRequest:
    return EngineRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens))


@contextlib.asynccontextmanager
async def running_engine(step_delay_s: float = 0.0, **client_options):
    client = AsyncEngineClient(make_core, (step_delay_s,), stats_interval_s=0.02, **client_options)
    await client.start()
    try:
        yield client
    finally:
        await client.shutdown()


async def collect(client: AsyncEngineClient, req: EngineRequest) -> list[RequestOutput]:
    return [output async for output in client.generate(req)]


async def wait_for_stats(client: AsyncEngineClient, predicate, timeout_s: float = 10.0) -> EngineStats:
    deadline = time.monotonic() + timeout_s
    while not predicate(client.stats()):
        assert time.monotonic() < deadline, f"stats never matched: {client.stats()}"
        await asyncio.sleep(0.01)
    return client.stats()


def test_concurrent_requests_stream_their_own_tokens():
    async def main():
        async with running_engine(step_delay_s=0.001) as client:
            assert client.is_alive
            prompts = {f"r{i}": [i, i + 1, 7] for i in range(8)}
            lengths = {f"r{i}": 5 + 3 * i for i in range(8)}
            results = await asyncio.gather(*(
                collect(client, request(rid, prompts[rid], lengths[rid])) for rid in prompts))
            for rid, outputs in zip(prompts, results):
                tokens = [t for out in outputs for t in out.new_token_ids]
                assert tokens == expected_tokens(prompts[rid], lengths[rid])
                assert "".join(out.new_text for out in outputs) == "".join(f"<{t}>" for t in tokens)
                assert [out.finish_reason for out in outputs][-1] == "length"
                assert all(out.finish_reason is None for out in outputs[:-1])
                assert outputs[-1].num_output_tokens == lengths[rid]
                assert outputs[-1].num_prompt_tokens == 3
            await wait_for_stats(client, lambda s: s.num_running == 0)

    asyncio.run(main())


def test_slow_consumer_gets_merged_deltas():
    async def main():
        async with running_engine() as client:
            outputs = []
            async for output in client.generate(request("slow", [5], 200)):
                outputs.append(output)
                await asyncio.sleep(0.01)  # the engine runs ahead; deltas pile up
            tokens = [t for out in outputs for t in out.new_token_ids]
            assert tokens == expected_tokens([5], 200)
            assert len(outputs) < 200
            assert outputs[-1].finished and outputs[-1].num_output_tokens == 200

    asyncio.run(main())


def test_leaving_the_stream_aborts_the_request_in_the_core():
    async def main():
        async with running_engine(step_delay_s=0.002) as client:
            # 1. The consumer breaks out of the loop.
            async with contextlib.aclosing(client.generate(request("broken", [1, 2], 10**6))) as stream:
                async for output in stream:
                    if output.num_output_tokens >= 3:
                        break
            await wait_for_stats(client, lambda s: "broken" in s.aborted)

            # 2. The consuming task is cancelled (e.g. the HTTP client disconnected).
            first = asyncio.Event()

            async def consume():
                async for _ in client.generate(request("cancelled", [3], 10**6)):
                    first.set()

            task = asyncio.create_task(consume())
            await first.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await wait_for_stats(client, lambda s: "cancelled" in s.aborted)

            # 3. Someone else aborts it: the consumer's stream ends with finish_reason "abort".
            stream = client.generate(request("explicit", [4], 10**6))
            await anext(stream)
            client.abort("explicit")
            rest = [output async for output in stream]
            assert rest[-1].finish_reason == "abort"
            stats = await wait_for_stats(client, lambda s: "explicit" in s.aborted and s.num_running == 0)
            assert stats.aborted == ("broken", "cancelled", "explicit")

            # The engine still serves new requests.
            outputs = await collect(client, request("after", [9], 4))
            assert [t for o in outputs for t in o.new_token_ids] == expected_tokens([9], 4)

    asyncio.run(main())


def test_refused_requests_raise_engine_error_and_the_engine_carries_on():
    async def main():
        async with running_engine() as client:
            with pytest.raises(EngineError) as refused:
                await collect(client, request("long", list(range(MAX_PROMPT_TOKENS + 1)), 4))
            assert refused.value.kind == "context_length"
            assert "max 64" in refused.value.message
            with pytest.raises(EngineError) as invalid:
                await collect(client, request("empty", [], 4))
            assert invalid.value.kind == "invalid"
            assert len(await collect(client, request("ok", [1], 3))) >= 1
            with pytest.raises(ValueError, match="already in flight"):
                stream = client.generate(request("dup", [1], 10**6))
                await anext(stream)
                await anext(client.generate(request("dup", [1], 1)))
            await stream.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("how", ["core_exits", "sigkill"])
def test_engine_death_fails_in_flight_requests_and_refuses_new_ones(how):
    async def main():
        client = AsyncEngineClient(make_core, (0.002,), stats_interval_s=0.02)
        await client.start()
        try:
            victims = [client.generate(request(f"v{i}", [i + 1], 10**6)) for i in range(3)]
            for stream in victims:
                await anext(stream)
            if how == "sigkill":
                os.kill(client.pid, signal.SIGKILL)
            else:
                with pytest.raises(EngineDeadError):
                    await anext(client.generate(request("crash", [CRASH_TOKEN], 10)))
            for stream in victims:
                with pytest.raises(EngineDeadError) as dead:
                    async for _ in stream:
                        pass
                assert ("SIGKILL" if how == "sigkill" else "exit code 3") in str(dead.value)
            assert not client.is_alive
            with pytest.raises(EngineDeadError):
                await anext(client.generate(request("late", [1], 1)))
        finally:
            await client.shutdown()

    asyncio.run(main())


def test_shutdown_fails_in_flight_requests():
    async def main():
        client = AsyncEngineClient(make_core, (0.002,))
        await client.start()
        stream = client.generate(request("r", [1], 10**6))
        await anext(stream)
        await client.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass
        assert not client.is_alive

    asyncio.run(main())


def test_startup_failure_reports_the_factory_error():
    async def main():
        client = AsyncEngineClient(failing_factory)
        with pytest.raises(EngineStartupError, match="FileNotFoundError: no model at /models/missing.gguf"):
            await client.start()
        assert not client.is_alive
        with pytest.raises(EngineDeadError, match="no model at"):
            await anext(client.generate(request("r", [1], 1)))

    asyncio.run(main())


def test_startup_failure_of_an_unimportable_factory():
    async def main():
        client = AsyncEngineClient("native_backend.no_such_module:make")
        with pytest.raises(EngineStartupError, match="No module named 'native_backend.no_such_module'"):
            await client.start()

    asyncio.run(main())


def test_startup_timeout_kills_the_engine():
    async def main():
        client = AsyncEngineClient(slow_factory, startup_timeout_s=0.5)
        with pytest.raises(EngineStartupError, match="did not start within 0.5 s"):
            await client.start()
        assert not client.is_alive
        assert client._process.exitcode is not None  # really gone, not left loading

    asyncio.run(main())
