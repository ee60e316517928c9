"""SLA classes, the bounded admission queue and shedding, against a real gateway on loopback."""

import threading
import time

import httpx
import pytest

from tests.support.servers.loopback import GatewayServer

CONFIG = """
sla_classes:
  - {name: interactive, priority: 0, max_queue_wait_s: 20}
  - {name: standard, priority: 5, max_queue_wait_s: 20}
  - {name: patient, priority: 5, max_queue_wait_s: 0.3}
  - {name: batch, priority: 10, max_queue_wait_s: 20, sheddable: true}
default_sla_class: standard
models:
  - name: one-slot
    queue: {max_size: 2, max_in_flight_per_deployment: 1}
    deployments:
      - name: slot-0
        backend: echo
        settings: {tokens_per_second: 40}
"""


@pytest.fixture()
def gw():
    with GatewayServer(CONFIG) as server:
        yield server


def complete(gw, sla=None, max_tokens=4, results=None, tag=None):
    headers = {"x-sla-class": sla} if sla else {}
    body = {"model": "one-slot", "prompt": f"{tag or 'x'} b c", "max_tokens": max_tokens}
    r = httpx.post(gw.base_url + "/v1/completions", json=body, headers=headers, timeout=30)
    if results is not None:
        results.append((tag, r.status_code, time.monotonic()))
    return r


def in_background(fn, *args, **kw) -> threading.Thread:
    t = threading.Thread(target=fn, args=args, kwargs=kw)
    t.start()
    return t


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def pool(gw):
    return gw.state.registry.resolve("one-slot")


def test_sheddable_class_is_refused_at_once_when_saturated(gw):
    results = []
    holder = in_background(complete, gw, max_tokens=40, results=results, tag="holder")
    wait_until(lambda: pool(gw).in_flight == 1)
    shed = complete(gw, sla="batch")
    assert shed.status_code == 503
    assert shed.json()["error"]["code"] == "server_is_overloaded"
    assert "shed" in shed.json()["error"]["message"]
    assert 1 <= int(shed.headers["retry-after"]) <= 120
    assert not results  # refused while the holder is still running: no waiting for a timeout
    holder.join()
    assert results[0][1] == 200
    assert complete(gw, sla="batch").status_code == 200  # not saturated any more: served


def test_queue_serves_higher_priority_first(gw):
    results = []
    threads = [in_background(complete, gw, max_tokens=20, results=results, tag="holder")]
    wait_until(lambda: pool(gw).in_flight == 1)
    threads.append(in_background(complete, gw, sla="standard", results=results, tag="standard"))
    wait_until(lambda: pool(gw).admission.queued == 1)
    threads.append(in_background(complete, gw, sla="interactive", results=results, tag="interactive"))
    wait_until(lambda: pool(gw).admission.queued == 2)
    for t in threads:
        t.join()
    assert [tag for tag, status, _ in results] == ["holder", "interactive", "standard"]
    assert all(status == 200 for _, status, _ in results)


def test_full_queue_refuses_with_503(gw):
    results = []
    threads = [in_background(complete, gw, max_tokens=30, results=results, tag="holder")]
    wait_until(lambda: pool(gw).in_flight == 1)
    for i in range(2):
        threads.append(in_background(complete, gw, results=results, tag=f"queued-{i}"))
    wait_until(lambda: pool(gw).admission.queued == 2)
    refused = complete(gw)
    assert refused.status_code == 503
    assert "queue" in refused.json()["error"]["message"]
    assert len(results) == 0
    for t in threads:
        t.join()
    assert sorted(s for _, s, _ in results) == [200, 200, 200]


def test_waiting_past_the_class_limit_is_refused_with_a_reason(gw):
    holder = in_background(complete, gw, max_tokens=40)
    wait_until(lambda: pool(gw).in_flight == 1)
    r = complete(gw, sla="patient")
    assert r.status_code == 503
    assert "over the 0.3 s allowed for class 'patient'" in r.json()["error"]["message"]
    assert pool(gw).admission.queued == 0
    holder.join()


def test_unknown_sla_class_is_a_400(gw):
    r = complete(gw, sla="gold")
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "x-sla-class"
    assert "gold" in r.json()["error"]["message"]


def test_priority_reaches_the_backend(gw):
    seen = []
    backend = gw.backend("slot-0")
    original = backend.generate

    def spy(request):
        seen.append(request.priority)
        return original(request)

    backend.generate = spy
    complete(gw, sla="interactive")
    complete(gw, sla="batch")
    assert seen == [0, 10]


class OneSlotPool:
    """ModelPool's side of admission for one deployment of one slot (take claims the breaker's
    probe the way ModelPool.take does); the breaker and the admission queue are the real ones."""

    name = "m"

    def __init__(self, deployment):
        self.deployment = deployment
        self.admission = None

    def take(self, request):
        d = self.deployment
        if d.in_flight >= 1 or not d.breaker.allows():
            return None
        d.in_flight += 1
        d.breaker.claim()
        return d

    def any_available(self, needs=None):
        return self.deployment.breaker.allows()

    def release(self, deployment):
        deployment.in_flight -= 1
        self.admission.wake()


def test_a_waiter_cancelled_as_it_is_granted_the_probe_gives_the_probe_back():
    """The race, made deterministic: a half-open deployment's slot frees, wake() grants it (and
    with it the one probe) to a queued request, and that request is cancelled before it runs."""
    import asyncio
    from types import SimpleNamespace

    from gateway.pools.admission import PoolAdmission, Ticket
    from gateway.pools.breaker import CircuitBreaker

    async def main():
        now = [0.0]
        breaker = CircuitBreaker(failures=1, cooldown_s=10, clock=lambda: now[0])
        breaker.record_failure()  # open
        deployment = SimpleNamespace(name="d", breaker=breaker, in_flight=1)  # and busy
        pool = OneSlotPool(deployment)
        pool.admission = admission = PoolAdmission(pool, max_queue=4)
        now[0] = 11.0  # cool-down over: half-open, the next request sent is the probe
        waiter = asyncio.create_task(admission.acquire(SimpleNamespace(needs=None), Ticket(0, False, 30)))
        await asyncio.sleep(0)
        assert admission.queued == 1
        waiter.cancel()  # the client leaves; before its task runs again, in the same turn of the loop,
        deployment.in_flight = 0
        admission.wake()  # the slot frees and is granted to it, and with it the probe
        assert breaker.probe_in_flight
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert deployment.in_flight == 0
        assert not breaker.probe_in_flight and breaker.allows()  # another request may probe it
        assert pool.take(SimpleNamespace(needs=None)) is deployment

    asyncio.run(main())
