"""vLLM's cache_salt through the native plugin: declared as a vendor field the gateway forwards,
handed to the engine request as is, and a value that is not a non-empty string refused with a
400 naming it (the engine half: tests/native_backend/test_kv_connector.py, test_kv_events.py)."""

from __future__ import annotations

import asyncio
import types

import pytest

from gateway.backend import GenerationRequest, SamplingParams
from gateway.errors import InvalidRequestError
from kvgate_native.backend import NATIVE_CAPABILITIES, make_native_backend


class RecordingClient:
    def __init__(self):
        self.requests = []

    async def generate(self, request):
        self.requests.append(request)
        return
        yield


def engine_request_of(extra: dict):
    backend = make_native_backend({}, "native-0")
    client = RecordingClient()
    backend.supervisor = types.SimpleNamespace(up=True, client=client)

    async def tokenized(request):
        return [1, 2, 3]

    backend._tokenized = tokenized

    async def drive():
        request = GenerationRequest(request_id="r", model="m", sampling=SamplingParams(), prompt="hi", extra=extra)
        async for _ in backend.generate(request):
            pass

    asyncio.run(drive())
    return client.requests[0]


def test_the_gateway_may_forward_cache_salt_to_a_native_deployment():
    assert "cache_salt" in NATIVE_CAPABILITIES.extras


@pytest.mark.parametrize("extra, salt", [({"cache_salt": "tenant-a"}, "tenant-a"), ({}, None),
                                         ({"cache_salt": None}, None)])
def test_cache_salt_reaches_the_engine_request(extra, salt):
    assert engine_request_of(extra).cache_salt == salt


@pytest.mark.parametrize("value", ["", 7, ["a"], True])
def test_a_cache_salt_that_is_not_a_non_empty_string_is_a_400_naming_it(value):
    with pytest.raises(InvalidRequestError) as refused:
        engine_request_of({"cache_salt": value})
    assert refused.value.param == "cache_salt"
