"""Every async generator a request opens is closed by the code that opened it, not by the GC.

The gateway stops reading a backend's stream at its finishing event (and when the client leaves)
and closes the stream it holds. A generator the backend iterates inside that stream must be
closed there too: one that is merely dropped is closed later by the event loop's finalizer hook,
which costs every stream an eventfd write, a loop wake-up and a task of its own (found in
strace, between a stream's last tokens and their write to the client). Here the loop's hook
records every generator handed to it while real requests run.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading

import httpx
import pytest

from tests.support.fakes import trtllm_standin as standin
from gateway.backend import GenerationRequest, SamplingParams
from kvgate_tensorrt_llm import make_tensorrt_llm_backend
from tests.support.servers.loopback import ECHO_GATEWAY, OPENAI_FRONT, GatewayServer

PROMPT = "the quick brown fox jumps"


class DroppedGenerators:
    """The qualified names of the async generators the running loop's finalizer hook closed.
    Generators first iterated after `install` (in the loop's thread) are seen."""

    def __init__(self):
        self.names: list[str] = []

    def install(self) -> None:
        hooks = sys.get_asyncgen_hooks()

        def finalizer(agen):
            self.names.append(agen.__qualname__)
            hooks.finalizer(agen)

        sys.set_asyncgen_hooks(firstiter=hooks.firstiter, finalizer=finalizer)

    def install_in(self, server: GatewayServer) -> None:
        installed = threading.Event()
        server.loop.call_soon_threadsafe(lambda: (self.install(), installed.set()))
        assert installed.wait(5)

    def after_collection(self) -> list[str]:
        gc.collect()  # a generator kept alive by a reference cycle is finalized now, not later
        return self.names


@pytest.fixture(scope="module")
def pair():
    with GatewayServer(ECHO_GATEWAY) as echo, GatewayServer(OPENAI_FRONT.format(base=echo.base_url)) as front:
        yield echo, front


@pytest.fixture
def dropped(pair):
    echo, front = pair
    seen = {"echo": DroppedGenerators(), "front": DroppedGenerators()}
    seen["echo"].install_in(echo)
    seen["front"].install_in(front)
    return seen


def _requests(client):
    completion = dict(model="echo", prompt=PROMPT, max_tokens=6)
    chat = dict(model="echo", messages=[{"role": "user", "content": PROMPT}], max_tokens=4)
    for stream in (False, True):
        options = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        for api, kw in ((client.completions, completion), (client.chat.completions, chat)):
            for n in (1, 2):
                answer = api.create(**kw, n=n, **options)
                if stream:
                    assert list(answer)


def test_a_generator_left_open_in_a_gateway_loop_is_seen(pair, dropped):
    """The positive control: in the gateway's own loop, a generator dropped after its first item
    is reported, one closed by its code is not (so an empty report below means none was left)."""
    _, front = pair

    async def numbers():
        yield 1
        yield 2

    async def open_two():
        left, closed = numbers(), numbers()
        await left.__anext__()
        await closed.__anext__()
        await closed.aclose()
    asyncio.run_coroutine_threadsafe(open_two(), front.loop).result(5)
    assert [name.rsplit(".", 1)[-1] for name in dropped["front"].after_collection()] == ["numbers"]
    assert dropped["echo"].after_collection() == []


def test_finished_streams_leave_no_generator_to_the_loop(pair, dropped):
    _, front = pair
    _requests(front.openai())  # through front (openai backend) to echo (echo backend)
    assert dropped["front"].after_collection() == []
    assert dropped["echo"].after_collection() == []


def test_a_client_leaving_mid_stream_leaves_no_generator_to_the_loop(pair, dropped):
    _, front = pair
    body = {"model": "echo", "prompt": PROMPT, "max_tokens": 300, "stream": True}
    with httpx.Client(base_url=front.base_url, timeout=10) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i == 3:
                    break
        # The gateways notice the disconnect on their own loops: wait until both are idle again.
        for _ in range(200):
            if client.get("/v1/models").status_code == 200 and not _busy(pair):
                break
    assert dropped["front"].after_collection() == []
    assert dropped["echo"].after_collection() == []


def _busy(pair) -> bool:
    echo, front = pair
    return bool(echo.backend("echo-0").load().running or front.backend("upstream-0").tracker.inflight)


def test_tensorrt_llm_stream_stopped_at_its_finish_leaves_no_generator(monkeypatch):
    standin.install(monkeypatch)
    backend = make_tensorrt_llm_backend({"model": "/models/llama-awq"}, "trt-0")
    request = GenerationRequest(request_id="r", model="m", sampling=SamplingParams(max_tokens=3),
                                prompt=[5, 6, 7, 8])
    seen = DroppedGenerators()

    async def main():
        seen.install()
        await backend.start()
        try:
            events = backend.generate(request)
            async for event in events:  # as the gateway reads: nothing after the finishing event
                if event.finish_reason is not None:
                    break
            await events.aclose()
        finally:
            await backend.stop()

    asyncio.run(main())
    assert seen.after_collection() == []
