"""Deployments discovered live (gateway/pools/discovery.py) against a real DNS server and real upstreams.

A dnslib server on loopback answers for `engines.test`; the upstreams are kvgate gateways serving
the echo backend, each on its own loopback address (127.0.0.2, .3, .4) and the same port, as the
pods behind a headless Service are. The front gateway reaches them with the openai backend, one
member per address, while the test changes the DNS answers under running streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time

import httpx
import pytest

from tests.support.servers.dns_server import DnsServer
from gateway.cli import main as kvgate_main
from gateway.hookspecs import hookimpl
from gateway.pools.discovery import DiscoveryFailed, DnsResolver
from tests.support.servers.loopback import GatewayServer, free_port_on

NAME = "engines.test"
A, B, C = "127.0.0.2", "127.0.0.3", "127.0.0.4"
PROMPT = "one two three four five"

UPSTREAM = """
models:
  - name: echo
    deployments:
      - {name: echo-0, backend: echo, settings: {tokens_per_second: 10}}
"""

FRONT = """
models:
  - name: echo
    policy: least_loaded
    deployments:
      - name: engines
        backend: openai
        upstream_model: echo
        settings: {{metrics: none}}
        discovery: {{dns: {name}, port: {port}, refresh_s: 0.5, timeout_s: 1, health_path: /health/ready,
                     resolver: "{resolver}", {extra}}}
"""
LOOPBACK = 'allowed_cidrs: ["127.0.0.0/8", "::1/128"]'  # the test's "pods" live on loopback


class Arrivals:
    """A kvgate plugin on an upstream: counts the requests it received (finished or not)."""

    def __init__(self):
        self.count = 0

    @hookimpl
    def request_started(self, request_id, model, sla_class):
        self.count += 1


class Upstream:
    def __init__(self, host: str, port: int):
        self.host = host
        self.arrivals = Arrivals()
        self.server = GatewayServer(UPSTREAM, extra_plugins={"arrivals": self.arrivals}, host=host, port=port)

    def in_flight(self) -> int:
        return self.server.state.registry.pools[0].in_flight

    def close(self) -> None:
        self.server.close()


def wait_for(condition, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def dns():
    with DnsServer() as server:
        yield server


@pytest.fixture
def port():
    return free_port_on([A, B, C])


@pytest.fixture
def stack():
    with contextlib.ExitStack() as s:
        yield s


def start_upstream(stack, host, port) -> Upstream:
    upstream = Upstream(host, port)
    stack.callback(upstream.close)
    return upstream


def start_front(stack, dns, port, extra: str = LOOPBACK) -> GatewayServer:
    front = GatewayServer(FRONT.format(name=NAME, port=port, resolver=dns.address, extra=extra))
    stack.enter_context(front)
    return front


def group_of(front):
    return front.state.registry.groups()[0]


def routed_names(front) -> list[str]:
    return [d.name for d in front.state.registry.pools[0].deployments]


def complete(client, max_tokens=2):
    reply = client.completions.create(model="echo", prompt=PROMPT, max_tokens=max_tokens)
    return reply.choices[0].text


def refreshes_until(group, condition, what: str) -> int:
    """How many refreshes began after the DNS change before `condition` held."""
    before = group.refreshes
    wait_for(condition, what)
    return group.refreshes - before


# ------------------------------------------------------------------------------ live membership

def test_members_follow_dns_while_streams_run(dns, port, stack):
    dns.set(NAME, [A])
    a, b = start_upstream(stack, A, port), start_upstream(stack, B, port)
    front = start_front(stack, dns, port)
    group, client = group_of(front), front.openai()
    assert routed_names(front) == [f"engines@{A}"]

    # A long stream on A, read one chunk at a time by this thread: it stays in flight until the
    # test lets it finish (A's echo slowed to 1 token/s: 40 s, far longer than what follows
    # takes on a loaded machine; at 10 tokens/s its 4 s could run out before A had drained).
    echo_a = a.server.backend("echo-0")
    echo_a.settings = echo_a.settings.model_copy(update={"tokens_per_second": 1})
    stream = iter(client.completions.create(model="echo", prompt=PROMPT, max_tokens=40, stream=True))
    first = next(stream)
    assert a.in_flight() == 1

    # A new address: routable within one refresh of the change, then it takes the new requests
    # (the least-loaded policy prefers it to A, which carries the stream).
    dns.set(NAME, [A, B])
    took = refreshes_until(group, lambda: f"engines@{B}" in routed_names(front), "B to become routable")
    assert took <= 2, f"B became routable {took} refreshes after the change"  # the one under way + one
    assert complete(client) == "one two"
    assert b.arrivals.count == 1

    # A removed address: draining at once, no new requests, and its stream goes on.
    dns.set(NAME, [B])
    took = refreshes_until(group, lambda: f"engines@{A}" not in routed_names(front), "A to leave the pool")
    assert took <= 2
    member_a = group.draining[A]
    assert member_a.in_flight == 1 and member_a.started
    a_before, b_before = a.arrivals.count, b.arrivals.count
    for _ in range(4):
        assert complete(client) == "one two"
    assert a.arrivals.count == a_before and b.arrivals.count == b_before + 4
    status = httpx.get(front.base_url + "/status.json").json()["models"][0]["discovery"][0]
    assert status["routable"] == [f"engines@{B}"]
    assert status["draining"] == [{"name": f"engines@{A}", "in_flight": 1}]

    # The stream ends normally, then the drained member's backend is stopped.
    echo_a.settings = echo_a.settings.model_copy(update={"tokens_per_second": 0})  # as fast as it can
    text = first.choices[0].text + "".join(c.choices[0].text for c in stream if c.choices)
    assert len(text.split()) == 40
    wait_for(lambda: A not in group.draining and not member_a.started, "A to be drained and stopped")
    metrics = httpx.get(front.base_url + "/metrics").text
    assert 'kvgate_discovery_members{deployment="engines",model="echo",state="routable"} 1.0' in metrics
    assert 'kvgate_discovery_members{deployment="engines",model="echo",state="draining"} 0.0' in metrics
    assert f'kvgate_deployment_up{{deployment="engines@{B}",model="echo"}} 1.0' in metrics
    assert f'kvgate_requests_total{{deployment="engines@{B}",model="echo",sla_class="standard",status="200"}} 5.0' in metrics
    assert f"engines@{A}" not in metrics  # a member gone for good leaves no series behind


def test_a_member_back_before_its_drain_ends_takes_its_place_in_address_order(dns, port, stack):
    dns.set(NAME, [A, B])
    for host in (A, B):
        start_upstream(stack, host, port)
    front = start_front(stack, dns, port)
    group, client = group_of(front), front.openai()
    wait_for(lambda: routed_names(front) == [f"engines@{A}", f"engines@{B}"], "A and B to be routable")
    with front.openai() as other:  # a stream on A (the least loaded of two idle members: the first)
        stream = iter(other.completions.create(model="echo", prompt=PROMPT, max_tokens=40, stream=True))
        next(stream)
        dns.set(NAME, [B])
        wait_for(lambda: A in group.draining, "A to drain")
        dns.set(NAME, [A, B])
        wait_for(lambda: A not in group.draining, "A to come back")
        assert routed_names(front) == [f"engines@{A}", f"engines@{B}"]  # not appended after B
        assert complete(client) == "one two"
        stream.close()


def test_a_new_member_is_routable_only_once_healthy(dns, port, stack):
    dns.set(NAME, [A, C])  # nothing listens on C yet
    a = start_upstream(stack, A, port)
    front = start_front(stack, dns, port)
    group, client = group_of(front), front.openai()
    assert routed_names(front) == [f"engines@{A}"]
    assert list(group.pending) == [C] and "ConnectError" in group.problems[C]
    for _ in range(3):
        assert complete(client) == "one two"
    assert a.arrivals.count == 3
    status = httpx.get(front.base_url + "/status.json").json()["models"][0]["discovery"][0]
    assert status["pending"][0]["name"] == f"engines@{C}" and "GET http://127.0.0.4" in status["pending"][0]["problem"]
    ready = httpx.get(front.base_url + "/health/ready")
    assert ready.status_code == 200  # a group is up while one member is
    assert ready.json()["deployments"][f"engines@{A}"] == "ready"
    assert ready.json()["deployments"][f"engines@{C}"].startswith(f"pending: GET http://{C}:{port}/health/ready: ")

    c = start_upstream(stack, C, port)
    wait_for(lambda: f"engines@{C}" in routed_names(front), "C to pass its health check")
    with front.openai() as other:  # a stream on A makes C the less loaded one
        stream = iter(other.completions.create(model="echo", prompt=PROMPT, max_tokens=20, stream=True))
        next(stream)
        assert complete(client) == "one two"
        assert c.arrivals.count == 1
        stream.close()


def test_an_empty_answer_drains_every_member(dns, port, stack):
    dns.set(NAME, [A])
    start_upstream(stack, A, port)
    front = start_front(stack, dns, port)
    group = group_of(front)
    dns.records.pop(NAME)  # NXDOMAIN: an answer (scaled to zero), not an outage
    wait_for(lambda: not routed_names(front) and not group.draining, "every member to drain")
    assert group.up is True
    with pytest.raises(Exception) as refused:
        complete(front.openai())
    assert getattr(refused.value, "status_code", None) == 503
    ready = httpx.get(front.base_url + "/health/ready")
    assert ready.status_code == 503
    assert ready.json()["deployments"] == {"engines": f"no member: {NAME} lists no address that is up"}


# ------------------------------------------------------------------------------ DNS outage

def test_dns_outage_keeps_the_last_members_and_says_so(dns, port, stack, caplog):
    caplog.set_level(logging.INFO, logger="kvgate.discovery")
    dns.set(NAME, [A, B])
    a, b = start_upstream(stack, A, port), start_upstream(stack, B, port)
    front = start_front(stack, dns, port)
    group, client = group_of(front), front.openai()

    dns.stop()
    wait_for(lambda: group.up is False, "the lookup to fail")
    failed_at = group.failures
    wait_for(lambda: group.failures >= failed_at + 3, "three more failed lookups")
    assert routed_names(front) == [f"engines@{A}", f"engines@{B}"]
    for _ in range(4):
        assert complete(client) == "one two"
    assert a.arrivals.count + b.arrivals.count == 4
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "DNS lookup" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # once per outage
    assert "keeping the last 2 known members" in warnings[0].getMessage()
    metrics = httpx.get(front.base_url + "/metrics").text
    assert 'kvgate_discovery_up{deployment="engines",model="echo"} 0.0' in metrics
    assert 'kvgate_discovery_members{deployment="engines",model="echo",state="routable"} 2.0' in metrics
    status = httpx.get(front.base_url + "/status.json").json()["models"][0]["discovery"][0]
    assert status["up"] is False and status["problem"].startswith(f"DNS lookup of {NAME} failed")
    assert httpx.get(front.base_url + "/health/ready").status_code == 200  # still serving: still ready

    dns.set(NAME, [B])
    dns.start()
    wait_for(lambda: group.up is True, "DNS to answer again")
    assert any("DNS answers again" in r.getMessage() for r in caplog.records)
    wait_for(lambda: routed_names(front) == [f"engines@{B}"], "A to be drained after the outage")
    assert 'kvgate_discovery_up{deployment="engines",model="echo"} 1.0' in httpx.get(front.base_url + "/metrics").text


def test_status_page_shows_the_outage(dns, port, stack, tmp_path):
    from tests.support.servers.browser import chromium, headless

    chromium()  # skips here when there is no browser (CI has one)
    dns.set(NAME, [A])
    start_upstream(stack, A, port)
    front = start_front(stack, dns, port)
    group = group_of(front)
    dns.stop()
    wait_for(lambda: group.up is False, "the lookup to fail")
    dom = headless(front.base_url + "/status", f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom").stdout
    line = dom.split('data-discovery="engines"')[1].split("</div>")[0]
    assert f"DNS lookup of {NAME} failed" in line and "keeping the last members" in line
    assert "1 routable, 0 pending, 0 draining" in line


def test_a_servfail_is_an_outage_too(dns, port, stack):
    dns.set(NAME, [A])
    start_upstream(stack, A, port)
    front = start_front(stack, dns, port)
    group = group_of(front)
    dns.servfail = True
    wait_for(lambda: group.up is False, "the lookup to fail")
    assert "SERVFAIL" in group.problem
    assert routed_names(front) == [f"engines@{A}"]
    assert complete(front.openai()) == "one two"


# ------------------------------------------------------------------------------ the resolver

def test_resolver_returns_every_a_and_aaaa_record(dns):
    dns.set(NAME, ["127.0.0.3", "::1", "127.0.0.2"])
    resolver = DnsResolver(dns.address, timeout_s=1)
    assert asyncio.run(resolver.addresses(NAME)) == ["127.0.0.2", "127.0.0.3", "::1"]
    assert asyncio.run(resolver.addresses(NAME + ".")) == ["127.0.0.2", "127.0.0.3", "::1"]
    assert asyncio.run(resolver.addresses("other.test")) == []  # NXDOMAIN: an empty set
    dns.stop()
    with pytest.raises(DiscoveryFailed):
        asyncio.run(resolver.addresses(NAME))


def test_a_large_pool_is_resolved_whole(dns):
    """300 pods: the answer (about 5 KB) does not fit in UDP; it comes truncated and is asked again
    over TCP, as CoreDNS answers a large headless Service."""
    pods = [f"10.0.{i // 200}.{i % 200 + 1}" for i in range(300)]
    dns.set(NAME, pods)
    resolver = DnsResolver(dns.address, timeout_s=5)
    assert asyncio.run(resolver.addresses(NAME)) == pods
    assert dns.tcp_queries >= 1


def test_an_ipv6_member_is_named_and_reached_in_brackets(dns, stack):
    dns.set(NAME, ["::1"])
    port6 = free_port_on(["::1"])
    start_upstream(stack, "::1", port6)
    front = start_front(stack, dns, port6)
    assert routed_names(front) == ["engines@::1"]
    assert front.backend("engines@::1").settings.base_url == f"http://[::1]:{port6}/v1"
    assert complete(front.openai()) == "one two"


# ------------------------------------------------------------------------------ config and reload

def check_config(tmp_path, text: str) -> tuple[int, str]:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = kvgate_main(["check-config", str(path)])
    return code, out.getvalue()


def deployment_yaml(fields: str) -> str:
    return f"models:\n  - name: m\n    deployments:\n      - {{name: pool, {fields}}}\n"


@pytest.mark.parametrize("fields,message", [
    ("backend: openai, discovery: {dns: 'not a name', port: 80}", "discovery.dns: 'not a name' is not a DNS name"),
    ("backend: openai, discovery: {dns: e.test, port: 0}", "discovery.port: Input should be greater than or equal to 1"),
    ("backend: openai, discovery: {dns: e.test}", "discovery.port: Field required"),
    ("backend: openai, discovery: {dns: e.test, port: 80, scheme: ftp}", "discovery.scheme: Input should be 'http' or 'https'"),
    ("backend: openai, discovery: {dns: e.test, port: 80, refresh_s: 0}", "discovery.refresh_s: Input should be greater"),
    ("backend: openai, discovery: {dns: e.test, port: 80, resolver: 'dns:53'}", "discovery.resolver: 'dns:53' is not an IP address and port"),
    ("backend: openai, discovery: {dns: e.test, port: 80, health_path: health}", "discovery.health_path: must start with /"),
    ("backend: openai, discovery: {dns: e.test, port: 80, ttl: 5}", "discovery.ttl: unknown key"),
    ("backend: openai, settings: {base_url: 'http://x/v1'}, discovery: {dns: e.test, port: 80}",
     "settings.base_url: discovery sets each member's base_url; remove it"),
    ("backend: echo, discovery: {dns: e.test, port: 80}", "backend 'echo' cannot take discovered endpoints"),
    ("backend: openai, settings: {metrics: bogus}, discovery: {dns: e.test, port: 80}", "settings.metrics: Input should be"),
])
def test_bad_discovery_configs_are_refused_with_the_path(tmp_path, fields, message):
    code, output = check_config(tmp_path, deployment_yaml(fields))
    assert code == 1 and "models[0].deployments[0]" in output and message in output, output


def test_check_config_names_what_it_will_resolve(tmp_path):
    code, output = check_config(tmp_path, deployment_yaml(
        "backend: openai, discovery: {dns: engines.llm.svc.cluster.local., port: 8000, refresh_s: 5}"))
    assert code == 0, output
    assert "1 found in DNS at run time" in output
    assert "m/pool: every address of engines.llm.svc.cluster.local., port 8000, every 5 s" in output


def test_member_names_cannot_be_written_by_hand(tmp_path):
    code, output = check_config(tmp_path, deployment_yaml("backend: echo, name: a@127.0.0.1"))
    assert code == 1 and "'@' is reserved for discovered members" in output, output


def test_reload_keeps_a_group_and_its_members_or_stops_it(dns, port, stack, tmp_path):
    from gateway.lifecycle.reload import reload_config

    dns.set(NAME, [A])
    start_upstream(stack, A, port)
    front = start_front(stack, dns, port)
    group = group_of(front)
    member = front.state.registry.deployments()[0]
    config = tmp_path / "front.yaml"
    config.write_text(FRONT.format(name=NAME, port=port, resolver=dns.address, extra=LOOPBACK))
    front.state.config_path = str(config)

    def reload():
        return asyncio.run_coroutine_threadsafe(reload_config(front.state), front.loop).result(30)

    assert reload()[0]
    assert group_of(front) is group and front.state.registry.deployments() == [member]
    dns.set(NAME, [A, B])  # the kept group still updates the pool now serving
    start_upstream(stack, B, port)
    wait_for(lambda: routed_names(front) == [f"engines@{A}", f"engines@{B}"], "B in the reloaded pool")

    config.write_text(FRONT.format(name=NAME, port=port, resolver=dns.address, extra=LOOPBACK).replace("refresh_s: 0.5", "refresh_s: 0.4"))
    assert reload()[0]
    assert group_of(front) is not group and not group.running
    wait_for(lambda: not member.started, "the old group's member to be retired")
    assert routed_names(front) == [f"engines@{A}", f"engines@{B}"]  # the new group found them again


# ------------------------------------------------------------------------------ what DNS may not do

def metric(front, name: str, **labels) -> float:
    for line in httpx.get(front.base_url + "/metrics").text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} {labels}")


def test_dns_cannot_make_loopback_metadata_or_unspecified_addresses_members(dns, port, stack, caplog):
    """Members are sent the deployment's key: by default an answer naming this host, the cloud
    metadata service, 0.0.0.0 or a multicast group gets no member there (logged and counted)."""
    dns.set(NAME, ["0.0.0.0", "10.255.0.9", "127.0.0.2", "169.254.169.254", "224.0.0.1"])
    with caplog.at_level(logging.WARNING, logger="kvgate.discovery"):
        front = start_front(stack, dns, port, extra="")
    group = group_of(front)
    assert list(group.pending) + list(group.routable) == ["10.255.0.9"]
    assert metric(front, "kvgate_discovery_addresses_dropped", reason="not_allowed") == 4
    assert "left out 4 not in the allowed networks" in caplog.text


# Each an IPv6 form that reaches loopback, link-local or the metadata service (RFC 4291's mapped
# and compatible forms, RFC 3056's 6to4, RFC 6052's NAT64 prefixes, RFC 4380's Teredo with its client
# 127.0.0.1 stored inverted, AWS's IPv6 metadata address), beside a pod address that must stay.
HIDDEN_V6 = ["::ffff:127.0.0.1", "::ffff:169.254.169.254", "::ffff:0.0.0.0", "::127.0.0.1",
             "2002:7f00:1::1", "2002:a9fe:a9fe::1", "64:ff9b::7f00:1", "64:ff9b::a9fe:a9fe",
             "64:ff9b:1::a9fe:a9fe", "2001:0:4136:e378:8000:63bf:80ff:fffe", "fd00:ec2::254"]


def test_aaaa_answers_cannot_reach_loopback_or_metadata_in_ipv4_clothing(dns, port, stack, caplog):
    dns.set(NAME, ["10.255.0.9", "fd12::9", *HIDDEN_V6])
    with caplog.at_level(logging.WARNING, logger="kvgate.discovery"):
        front = start_front(stack, dns, port, extra="")
    group = group_of(front)
    assert sorted(list(group.pending) + list(group.routable)) == ["10.255.0.9", "fd12::9"]
    assert metric(front, "kvgate_discovery_addresses_dropped", reason="not_allowed") == len(HIDDEN_V6)


def test_a_mapped_address_is_judged_by_its_ipv4_networks(dns, port, stack):
    """allowed_cidrs lists IPv4 pod networks: ::ffff:10.255.0.9 is that pod, ::ffff:127.0.0.2 is not."""
    dns.set(NAME, ["::ffff:10.255.0.9", "::ffff:127.0.0.2"])
    front = start_front(stack, dns, port, extra='allowed_cidrs: ["10.255.0.0/16"]')
    group = group_of(front)
    assert list(group.pending) + list(group.routable) == ["::ffff:10.255.0.9"]


def test_an_answer_over_max_members_is_cut_with_a_warning_and_a_metric(dns, port, stack, caplog):
    dns.set(NAME, [f"10.255.0.{i}" for i in range(1, 6)])
    with caplog.at_level(logging.WARNING, logger="kvgate.discovery"):
        front = start_front(stack, dns, port, extra="max_members: 2")
    group = group_of(front)
    assert sorted(list(group.pending) + list(group.routable)) == ["10.255.0.1", "10.255.0.2"]
    assert metric(front, "kvgate_discovery_addresses_dropped", reason="over_max_members") == 3
    assert "3 over max_members 2" in caplog.text


def test_the_records_ttl_bounds_the_refresh_interval(dns, port, stack):
    dns.set(NAME, [A])  # the test server's records live 1 s
    start_upstream(stack, A, port)
    front = GatewayServer(FRONT.format(name=NAME, port=port, resolver=dns.address, extra=LOOPBACK).replace(
        "refresh_s: 0.5", "refresh_s: 30"))
    stack.enter_context(front)
    group = group_of(front)
    assert group.ttl_s == 1.0 and group.next_refresh_s() == 1.0  # not 30 s on a stale answer


def test_a_flapping_member_keeps_its_open_breaker_through_its_drain(dns, port, stack):
    dns.set(NAME, [A])
    start_upstream(stack, A, port)
    front = start_front(stack, dns, port)
    group = group_of(front)
    member = group.routable[A]
    for _ in range(member.breaker.threshold):
        member.breaker.record_failure()
    assert member.breaker.state == "open"
    dns.set(NAME, [])
    wait_for(lambda: A not in group.routable and A not in group.draining, "the member to drain")
    dns.set(NAME, [A])
    wait_for(lambda: A in group.pending or A in group.routable, "the member to come back")
    back = group.pending.get(A) or group.routable.get(A)
    assert back is not member and back.breaker.state == "open"  # not a fresh, trusted member
