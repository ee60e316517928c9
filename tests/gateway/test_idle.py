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


def test_many_short_waits_outlast_the_limit_and_use_few_timers():
    async def main():
        loop = asyncio.get_running_loop()
        timers = 0
        call_at = loop.call_at

        def counting_call_at(when, callback, *args, **kwargs):
            nonlocal timers
            timers += getattr(callback, "__self__", None) is watch  # the watch's own timers only
            return call_at(when, callback, *args, **kwargs)

        watch = IdleWatch(0.1)
        loop.call_at = counting_call_at
        for _ in range(60):  # 0.3 s in all, 5 ms each
            await watch.read(asyncio.sleep(0.005))
        watch.close()
        return timers

    timers = asyncio.run(main())
    assert 1 <= timers <= 5  # about one per 0.1 s idle period, not one per read (60)


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
