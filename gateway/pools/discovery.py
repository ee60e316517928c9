"""Deployments discovered live: one member per address of a DNS name, kept current without a reload.

A deployment with `discovery: {dns, port, ...}` is a *group*. Every `refresh_s` the group
resolves every A and AAAA record of its name (a Kubernetes headless Service lists one per ready
pod) and reconciles its members, each a full `Deployment` named `name@address` (its own backend,
load, breaker and metrics labels):

    DNS answer ──> new address ──> pending (backend started, health check) ──ok──> routable
                   gone address ─> routable: draining (no new requests; in-flight ones finish,
                                   then its backend stops) / pending: stopped
    no answer (timeout, SERVFAIL, no server) ──> the last known members stay; logged once per
                                   outage, `up` false (metric kvgate_discovery_up, status page)

An authoritative "no such name" or "no records" is an answer, not a failure: the set is empty
(a StatefulSet scaled to zero) and every member drains. Resolution runs on the event loop with
dnspython's asyncio resolver, bounded by `timeout_s`; nothing blocks serving.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from typing import Callable

import dns.asyncresolver
import dns.exception
import dns.resolver
import httpx

from gateway.capabilities import DEFAULT_CAPABILITIES
from gateway.config import DeploymentConfig, resolver_address

log = logging.getLogger("kvgate.discovery")

DRAIN_POLL_S = 0.05


class DiscoveryFailed(Exception):
    """DNS gave no usable answer (as opposed to an answer with no address)."""


class DnsResolver:
    """Every A and AAAA address of a name, from /etc/resolv.conf's servers or one given server."""

    def __init__(self, server: str | None, timeout_s: float):
        self.server = server
        self.timeout_s = timeout_s
        self._resolver = None

    def _get(self) -> dns.asyncresolver.Resolver:
        if self._resolver is None:
            if self.server is None:
                try:  # reads /etc/resolv.conf once (search domains and ndots included, as in a pod)
                    self._resolver = dns.asyncresolver.Resolver()
                except dns.resolver.NoResolverConfiguration as exc:
                    raise DiscoveryFailed(f"no DNS configuration: {exc}") from None
            else:
                host, port = resolver_address(self.server)
                self._resolver = dns.asyncresolver.Resolver(configure=False)
                self._resolver.nameservers = [host]
                self._resolver.port = port
            # Answers up to 1232 bytes over UDP (about 70 addresses); a larger pool's answer comes
            # truncated and is asked again over TCP.
            self._resolver.use_edns(0, 0, 1232)
        return self._resolver

    async def addresses(self, name: str) -> list[str]:
        return (await self.lookup(name))[0]

    async def lookup(self, name: str) -> tuple[list[str], float | None]:
        """The addresses, in address order, and the answer's TTL in seconds (None: no records)."""
        (v4, ttl4), (v6, ttl6) = await asyncio.gather(self._query(name, "A"), self._query(name, "AAAA"))
        ttls = [t for t in (ttl4, ttl6) if t is not None]
        return sorted(set(v4) | set(v6), key=address_order), min(ttls, default=None)

    async def _query(self, name: str, rdtype: str) -> tuple[list[str], float | None]:
        resolver = self._get()
        try:
            answer = await resolver.resolve(name, rdtype, lifetime=self.timeout_s, search=True)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return [], None
        except dns.exception.Timeout:
            raise DiscoveryFailed(f"no answer within {self.timeout_s:g} s") from None
        except dns.resolver.NoNameservers:
            raise DiscoveryFailed("every DNS server failed (SERVFAIL, refused or unreachable)") from None
        except (dns.exception.DNSException, OSError) as exc:
            raise DiscoveryFailed(f"{type(exc).__name__}: {exc}") from None
        return [record.address for record in answer], float(answer.rrset.ttl)


class DiscoveryGroup:
    """One `discovery:` deployment of one model: its members and the loop that keeps them current.

    `make_member(name, base_url)` builds a member's Deployment (not started). The group is attached
    to the pool that routes to it (`attach`), which it tells when its routable members change.
    """

    def __init__(self, model: str, config: DeploymentConfig, make_member: Callable):
        self.model = model
        self.config = config
        self.name = config.name
        self.discovery = config.discovery
        self.make_member = make_member
        self.capabilities = DEFAULT_CAPABILITIES  # what its members declare (set when it is built)
        self.routable: dict[str, object] = {}  # address -> Deployment taking requests
        self.pending: dict[str, object] = {}  # started or starting, not (yet) healthy
        self.draining: dict[str, object] = {}  # gone from DNS, finishing its in-flight requests
        self.problems: dict[str, str] = {}  # address -> why a pending member is not routable yet
        self.up: bool | None = None  # None before the first resolution, then: did the last one answer
        self.problem: str | None = None  # why the last resolution failed
        self.down_since: float | None = None
        self.resolved_at: float | None = None
        self.refreshes = 0  # resolutions done, answered or not
        self.failures = 0  # resolutions that got no answer
        self.resolver = DnsResolver(self.discovery.resolver, self.discovery.timeout_s)
        self._pool = None
        self._task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # drains and stops under way (held: asyncio keeps weak refs)
        self._http: httpx.AsyncClient | None = None
        self.allowed = _networks(self.discovery.allowed_cidrs)
        self.dropped = {"not_allowed": 0, "over_max_members": 0}  # addresses left out of the last answer
        self.ttl_s: float | None = None  # of the last answer
        self._left: dict[str, tuple[float, object]] = {}  # address -> (forget at, breaker) of a drained member

    # -- what the pool sees ------------------------------------------------------------------

    def attach(self, pool) -> None:
        self._pool = pool

    def members(self) -> list:
        """Routable members, in address order."""
        return list(self.routable.values())

    @property
    def running(self) -> bool:
        """Started (from the first resolution on) and not stopped."""
        return self._http is not None

    def everyone(self) -> list:
        """Every member: routable, pending and draining."""
        return [*self.routable.values(), *self.pending.values(), *self.draining.values()]

    def draining_in_flight(self) -> int:
        return sum(d.in_flight for d in self.draining.values())

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Resolve once and admit what answers (so a gateway starts with its members), then keep
        refreshing in the background."""
        if self.running:
            return
        self._http = httpx.AsyncClient(timeout=self.discovery.timeout_s)
        await self.refresh()
        self._task = asyncio.get_running_loop().create_task(self._refresh_forever())

    async def stop_discovery(self) -> None:
        """Stop resolving and stop members not yet routable; routable and draining ones are left
        to their owners (a reload retires them once idle; `close` stops them)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        pending, self.pending = list(self.pending.values()), {}
        self.problems.clear()
        await asyncio.gather(*(d.stop() for d in pending))
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def close(self) -> None:
        """At shutdown: stop resolving and stop draining members now (routable ones are stopped by
        the registry with every other deployment)."""
        await self.stop_discovery()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        draining, self.draining = list(self.draining.values()), {}
        await asyncio.gather(*(d.stop() for d in draining))

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.next_refresh_s())
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad refresh
                log.exception("discovery of %s (model %s): refresh failed", self.name, self.model)

    # -- one refresh -------------------------------------------------------------------------

    def next_refresh_s(self) -> float:
        """refresh_s, shortened to the answer's TTL (a record is not trusted past it), though
        never under a second (or refresh_s, if shorter) for a TTL of 0."""
        every = self.discovery.refresh_s
        if self.ttl_s is None:
            return every
        return max(min(every, self.ttl_s), min(every, 1.0))

    async def refresh(self) -> None:
        """Resolve, drain what is gone, then start and health-check what is new."""
        try:
            found, self.ttl_s = await self.resolver.lookup(self.discovery.dns)
            addresses = self._admissible(found)
        except DiscoveryFailed as exc:
            self._failed(str(exc))
            addresses = None  # keep every known member
        else:
            self._answered(addresses)
            self._remove_gone(set(addresses))
        finally:
            self.refreshes += 1
        for address in addresses or ():
            if address not in self.routable and address not in self.pending:
                self._add(address)
        await self._admit_pending()

    def _admissible(self, addresses: list[str]) -> list[str]:
        """The answer's addresses a member may have: in the allowed networks (the members get the
        deployment's key: DNS must not point it at the metadata service or this host), at most
        max_members of them. What is left out is logged when it changes and counted."""
        allowed = [a for a in addresses if _allowed(a, self.allowed)]
        cap = self.discovery.max_members
        dropped = {"not_allowed": len(addresses) - len(allowed), "over_max_members": max(0, len(allowed) - cap)}
        if dropped != self.dropped and any(dropped.values()):
            refused = [a for a in addresses if a not in allowed]
            log.warning("discovery of %s (model %s): %s lists %d addresses; left out %d not in the allowed "
                        "networks%s and %d over max_members %d", self.name, self.model, self.discovery.dns,
                        len(addresses), dropped["not_allowed"], f" ({', '.join(refused[:5])})" if refused else "",
                        dropped["over_max_members"], cap)
        self.dropped = dropped
        return allowed[:cap]

    def _answered(self, addresses: list[str]) -> None:
        if self.up is False:
            log.info("discovery of %s (model %s): DNS answers again after %.1f s: %d addresses",
                     self.name, self.model, time.time() - (self.down_since or time.time()), len(addresses))
        elif not addresses and (self.up is None or self.routable or self.pending):
            log.warning("discovery of %s (model %s): %s has no address; no members", self.name, self.model,
                        self.discovery.dns)
        self.up, self.problem, self.down_since = True, None, None
        self.resolved_at = time.time()

    def _failed(self, reason: str) -> None:
        self.failures += 1
        self.problem = f"DNS lookup of {self.discovery.dns} failed: {reason}"
        if self.up is not False:  # once per outage
            self.down_since = time.time()
            log.warning("discovery of %s (model %s): %s; keeping the last %d known members until DNS answers",
                        self.name, self.model, self.problem, len(self.routable) + len(self.pending))
        self.up = False

    def _add(self, address: str) -> None:
        draining = self.draining.pop(address, None)
        if draining is not None:  # it came back before its drain finished: route to it again
            self.routable[address] = draining
            self._sort_routable()
            log.info("member %s of model %s is back in DNS: routable again", draining.name, self.model)
            self._changed()
            return
        member = self.pending[address] = self.make_member(f"{self.name}@{address}", self.base_url(address))
        forget_at, breaker = self._left.pop(address, (0.0, None))
        if breaker is not None and time.monotonic() < forget_at:  # a flapping member stays judged
            member.breaker.inherit(breaker)

    def _remove_gone(self, addresses: set[str]) -> None:
        gone = [a for a in self.routable if a not in addresses]
        for address in gone:
            member = self.draining[address] = self.routable.pop(address)
            log.info("member %s of model %s left DNS: draining (%d in flight)", member.name, self.model,
                     member.in_flight)
            self._background(self._drain(address, member))
        if gone:
            self._changed()
        for address in [a for a in self.pending if a not in addresses]:
            member = self.pending.pop(address)
            self.problems.pop(address, None)
            self._background(member.stop())

    def _background(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self, address: str, member) -> None:
        while member.in_flight and self.draining.get(address) is member:
            await asyncio.sleep(DRAIN_POLL_S)
        if self.draining.get(address) is not member:
            return  # back in DNS, or stopped by close()
        del self.draining[address]
        self._left = {a: kept for a, kept in self._left.items() if kept[0] > time.monotonic()}
        self._left[address] = (time.monotonic() + self.discovery.remember_s, member.breaker)
        await member.stop()
        log.info("member %s of model %s drained and stopped", member.name, self.model)

    async def _admit_pending(self) -> None:
        pending = list(self.pending.items())
        verdicts = await asyncio.gather(*(self._check(a, d) for a, d in pending))
        admitted = False
        for (address, member), problem in zip(pending, verdicts):
            if self.pending.get(address) is not member:
                continue  # removed while it was checked
            if problem is None:
                self.routable[address] = self.pending.pop(address)
                self.problems.pop(address, None)
                log.info("member %s of model %s is healthy: routable", member.name, self.model)
                admitted = True
            elif self.problems.get(address) != problem:
                self.problems[address] = problem
                log.warning("member %s of model %s is not routable yet: %s", member.name, self.model, problem)
        if admitted:
            self._sort_routable()
            self._changed()

    def _sort_routable(self) -> None:
        """Members in address order, however they arrived: every replica of the gateway then
        routes over the same list (policies that hash a prefix onto it pick the same member)."""
        self.routable = dict(sorted(self.routable.items(), key=lambda kv: address_order(kv[0])))

    async def _check(self, address: str, member) -> str | None:
        """None when the member may take requests, else why not."""
        if not member.started:
            try:
                async with asyncio.timeout(max(self.discovery.timeout_s, 30.0)):
                    await member.backend.start()
            except Exception as exc:  # noqa: BLE001 - one bad member must not stop the others
                member.start_error = str(exc) or type(exc).__name__
                return f"its backend failed to start: {member.start_error}"
            member.started, member.start_error = True, None
        load = member.backend.load()
        if not load.healthy:
            return load.problem or "its backend reports it unhealthy"
        if self.discovery.health_path is None:
            return None
        url = self.base_origin(address) + self.discovery.health_path
        try:
            response = await self._http.get(url)
        except httpx.HTTPError as exc:
            return f"GET {url}: {type(exc).__name__}"
        if not 200 <= response.status_code < 300:
            return f"GET {url}: HTTP {response.status_code}"
        return None

    def _changed(self) -> None:
        if self._pool is not None:
            self._pool.refresh_members()

    # -- names -------------------------------------------------------------------------------

    def base_origin(self, address: str) -> str:
        host = f"[{address}]" if ":" in address else address
        return f"{self.discovery.scheme}://{host}:{self.discovery.port}"

    def base_url(self, address: str) -> str:
        return self.base_origin(address) + self.discovery.path

    def readiness(self) -> dict[str, str]:
        """Lines for /health/ready beside the routable members': pending members, and the group
        itself while it has no member."""
        lines = {d.name: f"pending: {self.problems.get(a) or 'starting'}" for a, d in self.pending.items()}
        if not self.routable:
            lines[self.name] = self.problem or f"no member: {self.discovery.dns} lists no address that is up"
        return lines

    def status(self) -> dict:
        """For the status page and /status.json."""
        return {
            "deployment": self.name, "dns": self.discovery.dns, "port": self.discovery.port,
            "refresh_s": self.discovery.refresh_s, "ttl_s": self.ttl_s, "dropped": dict(self.dropped),
            "up": self.up, "problem": self.problem,
            "down_since": self.down_since, "resolved_at": self.resolved_at, "failures": self.failures,
            "routable": [d.name for d in self.routable.values()],
            "pending": [{"name": d.name, "problem": self.problems.get(a)} for a, d in self.pending.items()],
            "draining": [{"name": d.name, "in_flight": d.in_flight} for d in self.draining.values()],
        }


# Refused unless allowed_cidrs says otherwise: this host, cloud metadata, no address, broadcast.
REFUSED_BY_DEFAULT = ("is_loopback", "is_link_local", "is_unspecified", "is_multicast")
# Metadata services that none of those kinds covers (AWS's IPv6 one is a unique-local address).
REFUSED_NETWORKS = (ipaddress.ip_network("fd00:ec2::254/128"),)
# IPv6 prefixes that carry an IPv4 address in their last 32 bits: a connect to 64:ff9b::7f00:1
# through a NAT64 gateway, or to ::7f00:1 on a host that still maps IPv4-compatible addresses,
# reaches 127.0.0.1 (Python's is_loopback and friends look at the IPv6 address only).
NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
IPV4_COMPATIBLE = ipaddress.ip_network("::/96")


def _networks(cidrs: list[str] | None):
    return None if cidrs is None else [ipaddress.ip_network(c, strict=False) for c in cidrs]


def _allowed(address: str, networks) -> bool:
    ip = ipaddress.ip_address(address)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # the socket connects to this IPv4 address: judge it as one
    if networks is None:
        return not any(_refused(each) for each in [ip, *_embedded_ipv4(ip)])
    return any(ip in net for net in networks if net.version == ip.version)


def _refused(ip) -> bool:
    return any(getattr(ip, kind) for kind in REFUSED_BY_DEFAULT) or any(ip in net for net in REFUSED_NETWORKS)


def _embedded_ipv4(ip) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address may lead to: 6to4's, Teredo's client, NAT64's and an
    IPv4-compatible address's (::a.b.c.d, but not :: or ::1 themselves)."""
    if ip.version != 6:
        return []
    found = [ip.sixtofour] if ip.sixtofour is not None else []
    found += list(ip.teredo) if ip.teredo is not None else []
    if any(ip in net for net in NAT64) or (ip in IPV4_COMPATIBLE and int(ip) > 1):
        found.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return found


def address_order(address: str) -> tuple[int, int]:
    """IPv4 before IPv6, each in numeric order."""
    ip = ipaddress.ip_address(address)
    return ip.version, int(ip)
