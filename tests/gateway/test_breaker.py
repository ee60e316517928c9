"""The circuit breaker's state machine, on a clock the test controls."""

from gateway.pools.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker


def make(failures=3, cooldown=10.0):
    now = [0.0]
    return CircuitBreaker(failures, cooldown, clock=lambda: now[0]), now


def test_opens_after_consecutive_failures_only():
    b, _ = make()
    b.record_failure()
    b.record_failure()
    b.record_success()  # the streak is broken
    b.record_failure()
    b.record_failure()
    assert b.state == CLOSED and b.allows()
    b.record_failure()
    assert b.state == OPEN and not b.allows()


def test_half_open_lets_exactly_one_probe_through():
    b, now = make(failures=1, cooldown=5)
    b.record_failure()
    now[0] = 4.9
    assert not b.allows()
    now[0] = 5.0
    assert b.state == HALF_OPEN and b.allows()
    b.claim()
    assert not b.allows()  # the probe is out; nobody else until it reports
    b.record_success()
    assert b.state == CLOSED and b.allows()


def test_failed_probe_opens_for_another_cooldown():
    b, now = make(failures=2, cooldown=5)
    b.record_failure()
    b.record_failure()
    now[0] = 6
    b.claim()
    b.record_failure()
    assert b.state == OPEN and b.times_opened == 2
    now[0] = 10.9
    assert not b.allows()
    now[0] = 11
    assert b.allows()


def test_a_probe_with_no_verdict_is_released():
    b, now = make(failures=1, cooldown=1)
    b.record_failure()
    now[0] = 2
    b.claim()
    b.release_probe()
    assert b.allows()


def test_a_replaced_backend_process_starts_with_a_closed_breaker():
    incarnation = [1]
    now = [0.0]
    b = CircuitBreaker(2, 60, clock=lambda: now[0], incarnation=lambda: incarnation[0])
    b.record_failure()
    b.record_failure()
    assert b.state == OPEN and not b.allows()
    incarnation[0] = 2  # the engine was restarted and is up again
    assert b.state == CLOSED and b.allows()
    b.record_failure()  # the new process's failures count from zero
    assert b.state == CLOSED
    b.record_failure()
    assert b.state == OPEN
    assert b.state == OPEN  # reading the state again changes nothing while the process stays


def test_a_half_open_probe_of_the_old_process_does_not_block_the_new_one():
    incarnation = [1]
    now = [0.0]
    b = CircuitBreaker(1, 5, clock=lambda: now[0], incarnation=lambda: incarnation[0])
    b.record_failure()
    now[0] = 6
    b.claim()
    assert b.state == HALF_OPEN and not b.allows()
    incarnation[0] = 2
    assert b.allows()


def test_readiness_names_an_open_breaker_without_leaving_the_service():
    import httpx

    from tests.support.servers.loopback import GatewayServer

    config = """
models:
  - name: m
    breaker: {failures: 1, cooldown_s: 60}
    deployments:
      - {name: bad, backend: echo, settings: {fail_after_tokens: 0}}
      - {name: good, backend: echo}
"""
    with GatewayServer(config) as gw:
        deployment = next(d for d in gw.state.registry.deployments() if d.name == "bad")
        while deployment.breaker.state != OPEN:
            httpx.post(gw.base_url + "/v1/completions", json={"model": "m", "prompt": "a b", "max_tokens": 2})
        ready = httpx.get(gw.base_url + "/health/ready")
        assert ready.status_code == 200  # the process can serve: good is up, bad is up but cut off
        assert ready.json()["deployments"] == {"bad": "up, breaker open", "good": "ready"}
