"""The `openai` backend's aiohttp client (kvgate_openai/aiohttp_client.py: https and proxied
upstreams) keeps the keep-alive rule: a request a reused connection dropped is sent once more on a
new connection; a new connection that fails is the upstream's doing and is not retried.

Telling the two apart rests on aiohttp's `BaseConnector.connect` (called for every request) and
`Connection.protocol` (one object per TCP connection). These tests fail if aiohttp changes either:
a new connection taken for a reused one is retried, a reused one taken for new is not. Plain http
on loopback here (the client serves any URL; TLS is aiohttp's own business).

As h1.py, it never takes bytes an upstream sent unasked (a second answer to one request) for the
next request's answer (tests shared with tests/plugins/test_openai_h1.py).
"""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from kvgate_openai.aiohttp_client import AiohttpClient
from kvgate_openai.transport import UpstreamUnreachable
from tests.plugins.test_openai_h1 import (
    Upstream,
    _drop_reused,
    check_a_second_answer_is_nobodys,
    check_an_unsolicited_answer_is_nobodys,
    fetch,
    fixed,
    two_answers_to_the_first_request,
)


def client() -> AiohttpClient:
    return AiohttpClient(4, 4.0, connect_s=2.0, headers={"content-type": "application/json"})


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_sequential_requests_share_one_connection_and_none_is_retried():
    async def main():
        async with Upstream(fixed(b"ok")) as up:
            c = client()
            try:
                for _ in range(3):
                    assert await fetch(c, up.url) == (200, b"ok")
                assert len(up.connections) == 1 and c.reuse_retries == 0
            finally:
                await c.aclose()
    run(main())


@pytest.mark.parametrize("how", ["fin", "rst"])
def test_a_request_a_reused_connection_dropped_is_sent_once_more_on_a_new_one(how):
    async def main():
        async with Upstream(_drop_reused(how)) as up:
            c = client()
            try:
                for _ in range(3):
                    assert await fetch(c, up.url) == (200, b"ok")
                # 1 on A; 2 dropped by A, sent again on B (new, serves that one only); 3 on a new C
                assert c.reuse_retries == 1 and len(up.connections) == 3
                assert [len(conn.requests) for conn in up.connections] == [2, 1, 1]
            finally:
                await c.aclose()
    run(main())


@pytest.mark.parametrize("how", ["fin", "rst"])
def test_a_new_connection_that_drops_the_request_is_not_retried(how):
    async def answer(conn, head, body, reader, writer):
        if how == "rst":
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return False  # closed without an answer

    async def main():
        async with Upstream(answer) as up:
            c = client()
            try:
                with pytest.raises(UpstreamUnreachable):
                    await c.send("POST", up.url, b"{}", {})
                assert len(up.connections) == 1 and c.reuse_retries == 0
            finally:
                await c.aclose()
    run(main())


def test_a_refused_connection_is_unreachable_and_not_retried():
    async def main():
        async with Upstream(fixed(b"ok")) as up:
            url = up.url
        c = client()  # the upstream is gone: its port refuses
        try:
            with pytest.raises(UpstreamUnreachable):
                await c.send("POST", url, b"{}", {})
            assert c.reuse_retries == 0
        finally:
            await c.aclose()
    run(main())


def test_a_whole_second_answer_in_the_same_segment_is_never_read_into_the_first():
    async def main():
        async with Upstream(two_answers_to_the_first_request) as up:
            c = client()
            try:
                await check_a_second_answer_is_nobodys(up, c)
            finally:
                await c.aclose()
    run(main())


@pytest.mark.parametrize("loop_busy", [False, True], ids=["read", "unread"])
def test_an_unsolicited_answer_on_an_idle_connection_is_never_the_next_requests(loop_busy):
    async def main():
        c = client()
        try:
            await check_an_unsolicited_answer_is_nobodys(c, loop_busy)
        finally:
            await c.aclose()
    run(main())
