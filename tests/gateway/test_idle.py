"""gateway.idle.IdleWatch: the idle limit counts each wait, costs one timer per idle period
(not one per read), and never mistakes someone else's cancellation for its own."""

import asyncio

import pytest

from gateway.idle import IdleWatch


def test_a_wait_longer_than_the_limit_times_out():
    async def main():
        watch = IdleWatch(0.05)
        try:
            await watch.read(asyncio.sleep(5))
        finally:
            watch.close()

    with pytest.raises(TimeoutError):
        asyncio.run(main())


class ManualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only when the test moves it: the watch's timers are due
    by the test's arithmetic, not by how long a loaded machine took to run a callback."""

    def __init__(self):
        super().__init__()
        self.now = 0.0

    def time(self) -> float:
        return self.now


def test_many_short_waits_outlast_the_limit_and_use_few_timers():
    loop = ManualClockLoop()

    async def main():
        timers = 0
        call_at = loop.call_at

        def counting_call_at(when, callback, *args, **kwargs):
            nonlocal timers
            timers += getattr(callback, "__self__", None) is watch  # the watch's own timers only
            return call_at(when, callback, *args, **kwargs)

        def answer_after(seconds: float, future: asyncio.Future) -> None:
            loop.now += seconds  # the read waited this long, then its answer came
            future.set_result(None)

        watch = IdleWatch(0.1)
        loop.call_at = counting_call_at
        for _ in range(60):  # 0.3 s in all, 5 ms each
            answer = loop.create_future()
            loop.call_soon(answer_after, 0.005, answer)
            await watch.read(answer)
        watch.close()
        return timers

    try:
        timers = loop.run_until_complete(main())
    finally:
        loop.close()
    assert timers == 3  # one per 0.1 s idle period (due at 0.1, 0.2, 0.3), not one per read (60)


def test_a_cancellation_from_elsewhere_stays_a_cancellation():
    async def main():
        watch = IdleWatch(5)
        reader = asyncio.create_task(watch.read(asyncio.sleep(10)))
        await asyncio.sleep(0.01)
        reader.cancel()
        try:
            await reader
        finally:
            watch.close()

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())


def test_after_a_timeout_the_task_is_not_left_cancelling():
    async def main():
        watch = IdleWatch(0.02)
        with pytest.raises(TimeoutError):
            await watch.read(asyncio.sleep(1))
        watch.close()
        assert asyncio.current_task().cancelling() == 0
        await asyncio.sleep(0.01)  # the task goes on normally
        return True

    assert asyncio.run(main())
