"""A stream's writes carry what its producer made while the last write was out (gateway.http.asgi.coalesced_until_end):
nothing lost or reordered, nothing held back, errors and cancellation still reach both ends."""

import asyncio

import pytest

from gateway.http.asgi import EventStreamResponse, coalesced_until_end


async def coalesced(chunks, **kwargs):
    """The writes without their last-write marks."""
    writes = coalesced_until_end(chunks, **kwargs)
    try:
        async for body, _ in writes:
            yield body
    finally:
        await writes.aclose()


async def collect(chunks, **kwargs):
    return [body async for body in coalesced(chunks, **kwargs)]


async def ready_at_once(n):
    for i in range(n):
        yield b"%d," % i  # no await between chunks: all of them are there before the first write


def test_chunks_made_together_leave_in_one_write_in_order():
    writes = asyncio.run(collect(ready_at_once(50)))
    assert b"".join(writes) == b"".join(b"%d," % i for i in range(50))
    assert len(writes) == 1


async def first_then_second(writer):
    """What `writer` (coalesced or coalesced_until_end) makes of a producer that yields its first
    chunk, then waits until that chunk has been taken before it yields the second."""
    release = asyncio.Event()

    async def slow():
        yield b"first"
        await release.wait()
        yield b"second"

    writes = writer(slow())
    first = await asyncio.wait_for(anext(writes), 5)  # the producer is still waiting
    release.set()
    return [first] + [w async for w in writes]


def test_a_chunk_is_not_held_back_waiting_for_the_next():
    assert asyncio.run(first_then_second(coalesced)) == [b"first", b"second"]


def test_a_slow_reader_holds_at_most_max_bytes_before_the_producer_waits():
    async def main():
        made = []

        async def producer():
            for i in range(100):
                made.append(i)
                yield b"x" * 10

        writes = coalesced(producer(), max_bytes=100)
        first = await anext(writes)
        await asyncio.sleep(0.05)  # the reader stalls: the producer stops at the bound
        stalled_at = len(made)
        rest = [b async for b in writes]
        return first, stalled_at, rest

    first, stalled_at, rest = asyncio.run(main())
    assert stalled_at <= 11 + 10  # the first write, then at most 100 bytes more
    assert len(first) + sum(map(len, rest)) == 1000


def test_an_error_of_the_producer_comes_after_what_it_made():
    async def failing():
        yield b"a"
        yield b"b"
        raise RuntimeError("upstream broke")

    async def main():
        got = []
        with pytest.raises(RuntimeError, match="upstream broke"):
            async for body in coalesced(failing()):
                got.append(body)
        return b"".join(got)

    assert asyncio.run(main()) == b"ab"


def test_closing_the_writes_stops_the_producer_and_runs_its_cleanup():
    async def main():
        cleaned = asyncio.Event()

        async def endless():
            try:
                while True:
                    yield b"tick"
                    await asyncio.sleep(0.001)
            finally:
                cleaned.set()

        writes = coalesced(endless())
        await anext(writes)
        await writes.aclose()
        return cleaned.is_set()

    assert asyncio.run(main())


# -- the last write ends the body (coalesced_until_end, EventStreamResponse) ---------------------

async def marked(chunks):
    return [pair async for pair in coalesced_until_end(chunks)]


def test_a_write_made_after_the_producer_ended_is_marked_last():
    assert asyncio.run(marked(ready_at_once(3))) == [(b"0,1,2,", True)]


def test_a_write_the_producer_may_still_follow_is_not_marked_last():
    assert asyncio.run(first_then_second(coalesced_until_end)) == [(b"first", False), (b"second", True)]


def test_no_write_is_marked_last_when_the_producer_fails():
    async def failing():
        yield b"a"
        raise RuntimeError("upstream broke")

    async def main():
        got = []
        with pytest.raises(RuntimeError):
            async for pair in coalesced_until_end(failing()):
                got.append(pair)
        return got

    assert asyncio.run(main()) == [(b"a", False)]


def _asgi_messages(chunks) -> list[dict]:
    """What an EventStreamResponse sends, through the ASGI interface alone."""
    sent: list[dict] = []

    async def main():
        async def receive():
            await asyncio.Event().wait()  # the client stays

        async def send(message):
            sent.append(message)

        await EventStreamResponse(chunks)({"type": "http"}, receive, send)

    asyncio.run(main())
    return sent


def test_a_stream_ready_at_its_end_ends_with_its_last_write():
    sent = _asgi_messages(ready_at_once(3))
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[1] == {"type": "http.response.body", "body": b"0,1,2,", "more_body": False}


def test_a_stream_that_ends_after_its_last_write_ends_with_an_empty_one():
    async def then_nothing():
        yield b"data"
        await asyncio.sleep(0.01)  # the write went out before the end was known

    sent = _asgi_messages(then_nothing())
    assert [(m.get("body"), m.get("more_body")) for m in sent[1:]] == [(b"data", True), (b"", False)]
